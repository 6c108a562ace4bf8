//! Paged KV caches on the device, for a model holding several sequences (docs/ARCHITECTURE.md,
//! "Paged KV caches").
//!
//! Each cache buffer (the keys or the values of one attention layer) is a range of virtual
//! addresses reserved once for every slot's `n_ctx` positions, so the kernels, their strides
//! and the captured graphs are those of a contiguous cache. Physical memory comes in granules
//! (the driver's allocation unit) mapped into a slot's part of each range as the slot grows,
//! from a pool with a byte budget. Every granule not yet backed maps one shared zeroed granule,
//! so a kernel that reads a tile past a sequence's last position reads zeros, never an
//! unmapped address. A slot's room is set aside before its tokens are evaluated
//! ([`KvPages::reserve`]); a slot whose request ended keeps its granules (a later prompt may
//! reuse its prefix) until another slot needs the room, and then its position falls to 0.
//!
//! [`PageBook`] is the accounting alone (which granule of which slot is mapped, what each slot
//! has set aside), tested without a GPU; [`KvPages`] carries its decisions out with the driver.

use std::sync::Arc;

use cudarc::driver::sys;
use cudarc::driver::{CudaContext, CudaStream};

use crate::device::driver;
use crate::schedule::DecodePlan;
use crate::{CudaError, CudaTuning};

/// The paged caches' shape and pool size for a plan, decided before any memory is taken.
#[derive(Debug)]
pub(crate) struct PagePool {
    /// The driver's allocation unit.
    pub granule: usize,
    /// Bytes of a position's row in each range: the keys, then the values, of each layer
    /// with a cache, in layer order.
    pub rows: Vec<usize>,
    /// Each layer's place among the layers with a cache (its ranges are `2 r` and `2 r + 1`),
    /// `None` for a layer without one.
    pub range_of: Vec<Option<usize>>,
    /// Granules of the pool.
    pub capacity: usize,
}

impl PagePool {
    /// The pool for `slots` slots of `plan` on `ordinal`: `--kv-memory`'s bytes, or without it
    /// every slot's whole context where `free` bytes hold it beside the weights with an
    /// eighth of the device to spare (under `--gpu-memory`, at most a quarter of that budget),
    /// and never less than one whole context. `None` without `--kv-memory` where whole
    /// granules would take more than half again the bytes of the contexts themselves (short
    /// contexts): those caches are allocated whole.
    pub fn plan(
        plan: &DecodePlan,
        ctx: &Arc<CudaContext>,
        ordinal: usize,
        slots: usize,
        tuning: &CudaTuning,
        free: u64,
    ) -> Result<Option<PagePool>, CudaError> {
        let granule = KvPages::granule(ctx, ordinal)?;
        let mut range_of = vec![None; plan.layers.len()];
        let mut rows = Vec::new();
        for l in (0..plan.layers.len()).filter(|&l| plan.kv_dims[l] > 0) {
            range_of[l] = Some(rows.len() / 2);
            rows.extend([2 * plan.kv_dims[l]; 2]);
        }
        let per_slot: usize = rows
            .iter()
            .map(|&r| (plan.n_ctx * r).div_ceil(granule))
            .sum();
        let full = per_slot * slots;
        let whole: usize = rows.iter().map(|&r| plan.n_ctx * r).sum();
        if tuning.kv_memory.is_none() && 2 * per_slot * granule > 3 * whole {
            return Ok(None);
        }
        let capacity = match tuning.kv_memory {
            Some(bytes) => {
                let granules = bytes as usize / granule;
                if granules < per_slot {
                    return Err(CudaError::Model(format!(
                        "--kv-memory of {} MB holds less than one sequence's context of {}                          positions, which needs {} MB",
                        bytes >> 20,
                        plan.n_ctx,
                        (per_slot * granule) >> 20
                    )));
                }
                granules.min(full)
            }
            None => {
                let weights = plan.weight_bytes_total() + crate::prefill::scratch_bytes(plan);
                let mut room = free.saturating_sub(weights + free / 8) / granule as u64;
                if let Some(budget) = tuning.gpu_memory {
                    room = room.min(budget / 4 / granule as u64);
                }
                (room as usize).clamp(per_slot, full)
            }
        };
        Ok(Some(PagePool {
            granule,
            rows,
            range_of,
            capacity,
        }))
    }

    /// Device bytes the caches can take: the pool, the zero granule and the spare slot's.
    pub fn device_bytes(&self) -> u64 {
        ((self.capacity + 1 + self.rows.len()) * self.granule) as u64
    }
}

/// One cache buffer's shape: bytes of one position's row, granules of one slot's part.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RangeShape {
    pub row_bytes: usize,
    pub region_granules: usize,
}

/// A change of mapping [`PageBook::reserve`] decides, in the order it is to be made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Change {
    /// Back granule `granule` of `slot`'s part of range `range` with a pool granule.
    Map {
        slot: usize,
        range: usize,
        granule: usize,
    },
    /// Give that granule back to the pool (the shared zero granule maps there again).
    Unmap {
        slot: usize,
        range: usize,
        granule: usize,
    },
}

/// What a reservation needs done: the mapping changes, and the idle slots whose caches it
/// took (their positions fall to 0).
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Changes {
    pub changes: Vec<Change>,
    pub evicted: Vec<usize>,
}

/// Why a reservation can never be met: the slot alone needs more than the pool.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct NeverFits {
    pub needed: usize,
    pub capacity: usize,
}

/// The accounting of the pool's granules (see the module documentation).
#[derive(Debug)]
pub(crate) struct PageBook {
    granule: usize,
    ranges: Vec<RangeShape>,
    /// Granules the pool may hold in all.
    capacity: usize,
    /// Granules of the pool not mapped anywhere.
    free: usize,
    /// Granules each slot has set aside (0: its request ended, or none began).
    reserved: Vec<usize>,
    /// Granules mapped per slot and range: granules `0..mapped[s][r]` of the slot's part.
    mapped: Vec<Vec<usize>>,
    /// When each idle slot's request ended, to give the longest idle cache away first.
    idle_since: Vec<u64>,
    clock: u64,
}

impl PageBook {
    /// A pool of `capacity` granules of `granule` bytes for `slots` slots over `ranges`.
    pub fn new(granule: usize, ranges: Vec<RangeShape>, slots: usize, capacity: usize) -> Self {
        PageBook {
            granule,
            capacity,
            free: capacity,
            reserved: vec![0; slots],
            mapped: vec![vec![0; ranges.len()]; slots],
            idle_since: vec![0; slots],
            ranges,
            clock: 0,
        }
    }

    /// Granules of each range that hold positions `0..positions`.
    fn granules_for(&self, positions: usize) -> Vec<usize> {
        self.ranges
            .iter()
            .map(|r| {
                (positions * r.row_bytes)
                    .div_ceil(self.granule)
                    .min(r.region_granules)
            })
            .collect()
    }

    /// Granules of the pool.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Granules mapped for `slot`.
    pub fn mapped(&self, slot: usize) -> usize {
        self.mapped[slot].iter().sum()
    }

    /// Positions `slot`'s mapped granules hold in every range.
    #[cfg(test)]
    pub fn held_positions(&self, slot: usize) -> usize {
        self.ranges
            .iter()
            .zip(&self.mapped[slot])
            .map(|(r, &m)| {
                if m >= r.region_granules {
                    usize::MAX
                } else {
                    m * self.granule / r.row_bytes
                }
            })
            .min()
            .unwrap_or(usize::MAX)
    }

    /// Sets aside room for `slot` to hold `positions` positions, and says which mappings to
    /// change for it: `Ok(None)` when other slots' requests hold too much of the pool now;
    /// `Err` when the pool could never hold it.
    pub fn reserve(&mut self, slot: usize, positions: usize) -> Result<Option<Changes>, NeverFits> {
        let want = self.granules_for(positions);
        let needed: usize = want.iter().sum();
        if needed > self.capacity {
            return Err(NeverFits {
                needed,
                capacity: self.capacity,
            });
        }
        let mut out = Changes::default();
        if self.reserved[slot] >= needed && self.mapped[slot].iter().zip(&want).all(|(m, w)| m >= w)
        {
            return Ok(Some(out));
        }
        let others: usize = (0..self.reserved.len())
            .filter(|&s| s != slot)
            .map(|s| self.reserved[s])
            .sum();
        if others + needed > self.capacity {
            return Ok(None);
        }
        if self.reserved[slot] == 0 {
            // A request starts in this slot: what its cache held past its room goes back.
            for (r, &w) in want.iter().enumerate() {
                while self.mapped[slot][r] > w {
                    self.mapped[slot][r] -= 1;
                    self.free += 1;
                    out.changes.push(Change::Unmap {
                        slot,
                        range: r,
                        granule: self.mapped[slot][r],
                    });
                }
            }
        }
        self.reserved[slot] = self.reserved[slot].max(needed);
        for (r, &w) in want.iter().enumerate() {
            while self.mapped[slot][r] < w {
                if self.free == 0 {
                    self.evict_one(slot, &mut out);
                }
                self.free -= 1;
                out.changes.push(Change::Map {
                    slot,
                    range: r,
                    granule: self.mapped[slot][r],
                });
                self.mapped[slot][r] += 1;
            }
        }
        Ok(Some(out))
    }

    /// Unmaps the whole cache of the idle slot that has been idle longest. One exists whenever
    /// the pool is empty and a reservation is short: the slots with requests map at most what
    /// they set aside, and together they set aside at most the pool.
    fn evict_one(&mut self, not: usize, out: &mut Changes) {
        let victim = (0..self.reserved.len())
            .filter(|&s| s != not && self.reserved[s] == 0 && self.mapped(s) > 0)
            .min_by_key(|&s| self.idle_since[s])
            .expect("an idle slot holds granules when the pool is empty");
        for r in 0..self.ranges.len() {
            while self.mapped[victim][r] > 0 {
                self.mapped[victim][r] -= 1;
                self.free += 1;
                out.changes.push(Change::Unmap {
                    slot: victim,
                    range: r,
                    granule: self.mapped[victim][r],
                });
            }
        }
        out.evicted.push(victim);
    }

    /// `slot`'s request has ended: its room goes back to the pool; its granules stay mapped
    /// until another slot needs them.
    pub fn release(&mut self, slot: usize) {
        if self.reserved[slot] > 0 {
            self.reserved[slot] = 0;
            self.clock += 1;
            self.idle_since[slot] = self.clock;
        }
    }
}

fn check(what: &str, r: sys::CUresult) -> Result<(), CudaError> {
    r.result().map_err(driver(what))
}

/// The device side of the paged caches (see the module documentation).
pub(crate) struct KvPages {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    book: PageBook,
    ordinal: i32,
    granule: usize,
    /// Each range's base address and the bytes of one slot's part.
    bases: Vec<(u64, usize)>,
    /// Each layer's place among the layers with a cache ([`PagePool::range_of`]).
    range_of: Vec<Option<usize>>,
    slots: usize,
    /// The shared zeroed granule, mapped wherever no pool granule is.
    zero: sys::CUmemGenericAllocationHandle,
    /// The spare slot's first granule of each range (the padding rows of batched steps write
    /// position 0 there).
    spare: Vec<sys::CUmemGenericAllocationHandle>,
    /// Pool granules made and not mapped.
    free: Vec<sys::CUmemGenericAllocationHandle>,
    /// The pool granule behind each slot's range's granule, where one is.
    backing: Vec<Vec<Vec<sys::CUmemGenericAllocationHandle>>>,
}

impl KvPages {
    /// The driver's allocation unit on `ordinal`.
    pub fn granule(ctx: &Arc<CudaContext>, ordinal: usize) -> Result<usize, CudaError> {
        ctx.bind_to_thread()
            .map_err(driver("binding the context"))?;
        let prop = props(ordinal as i32);
        let mut granule = 0usize;
        // SAFETY: `prop` describes device memory on `ordinal`; the call writes one usize.
        check("reading the allocation granularity", unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granule,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        })?;
        Ok(granule.max(1))
    }

    /// Reserves one range per entry of `pool.rows` (bytes of a position's row) for `slots`
    /// slots and a spare of `n_ctx` positions each, with `pool.capacity` granules at most;
    /// maps the zero granule everywhere and the spare slot's first granules.
    pub fn new(
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        ordinal: usize,
        pool: &PagePool,
        n_ctx: usize,
        slots: usize,
    ) -> Result<KvPages, CudaError> {
        let (granule, capacity) = (pool.granule, pool.capacity);
        let shapes: Vec<RangeShape> = pool
            .rows
            .iter()
            .map(|&row_bytes| RangeShape {
                row_bytes,
                region_granules: (n_ctx * row_bytes).div_ceil(granule),
            })
            .collect();
        let mut pages = KvPages {
            ctx: ctx.clone(),
            stream: stream.clone(),
            book: PageBook::new(granule, shapes.clone(), slots, capacity),
            ordinal: ordinal as i32,
            granule,
            bases: Vec::new(),
            range_of: pool.range_of.clone(),
            slots,
            zero: 0,
            spare: Vec::new(),
            free: Vec::new(),
            backing: vec![vec![Vec::new(); shapes.len()]; slots],
        };
        pages.bind()?;
        pages.zero = pages.create()?;
        for shape in &shapes {
            let part = shape.region_granules * granule;
            let size = part * (slots + 1);
            let mut base: sys::CUdeviceptr = 0;
            // SAFETY: reserves address space only; freed in Drop.
            check("reserving cache addresses", unsafe {
                sys::cuMemAddressReserve(&mut base, size, granule, 0, 0)
            })?;
            pages.bases.push((base, part));
            for g in 0..shape.region_granules * (slots + 1) {
                pages.map(base + (g * granule) as u64, pages.zero)?;
            }
        }
        // The zero granule is zeroed through its first mapping.
        if let Some(&(base, _)) = pages.bases.first() {
            pages.zero_at(base)?;
        }
        for r in 0..shapes.len() {
            let at = pages.address(slots, r, 0);
            let h = pages.create()?;
            pages.remap(at, h)?;
            pages.spare.push(h);
        }
        pages
            .stream
            .synchronize()
            .map_err(driver("zeroing the caches"))?;
        Ok(pages)
    }

    /// The address of layer `l`'s keys (or `values`) cache buffer (0: the layer has none).
    pub fn cache(&self, l: usize, values: bool) -> u64 {
        self.range_of[l].map_or(0, |r| self.bases[2 * r + usize::from(values)].0)
    }

    /// Halfs between one slot's part of layer `l`'s caches and the next's (0: none).
    pub fn slot_stride(&self, l: usize) -> usize {
        self.range_of[l].map_or(0, |r| self.bases[2 * r].1 / 2)
    }

    /// Bytes of the pool not made yet.
    pub fn unmade_bytes(&self) -> u64 {
        let made = self.free.len() + self.backing.iter().flatten().map(Vec::len).sum::<usize>();
        ((self.book.capacity() - made) * self.granule) as u64
    }

    /// Bytes of the pool.
    pub fn capacity_bytes(&self) -> u64 {
        (self.book.capacity() * self.granule) as u64
    }

    fn address(&self, slot: usize, r: usize, granule: usize) -> u64 {
        let (base, part) = self.bases[r];
        base + (slot * part + granule * self.granule) as u64
    }

    fn bind(&self) -> Result<(), CudaError> {
        self.ctx
            .bind_to_thread()
            .map_err(driver("binding the context"))
    }

    fn create(&self) -> Result<sys::CUmemGenericAllocationHandle, CudaError> {
        let prop = props(self.ordinal);
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: one granule of device memory on our device; released in Drop.
        let r = unsafe { sys::cuMemCreate(&mut h, self.granule, &prop, 0) };
        if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            return Err(CudaError::OutOfMemory {
                needed: self.granule as u64,
                free: 0,
            });
        }
        check("allocating cache memory", r)?;
        Ok(h)
    }

    fn map(&self, at: u64, h: sys::CUmemGenericAllocationHandle) -> Result<(), CudaError> {
        // SAFETY: `at` is a granule of a range we reserved, not mapped now.
        check("mapping cache memory", unsafe {
            sys::cuMemMap(at, self.granule, 0, h, 0)
        })?;
        let desc = sys::CUmemAccessDesc {
            location: location(self.ordinal),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the granule was just mapped.
        check("opening cache memory", unsafe {
            sys::cuMemSetAccess(at, self.granule, &desc, 1)
        })
    }

    /// Maps `h` at `at` in place of what is there, and zeroes it (in stream order).
    fn remap(&self, at: u64, h: sys::CUmemGenericAllocationHandle) -> Result<(), CudaError> {
        // SAFETY: `at` is a mapped granule of ours; the stream was synchronized before any
        // change (`reserve`), so no kernel reads it now.
        check("unmapping cache memory", unsafe {
            sys::cuMemUnmap(at, self.granule)
        })?;
        self.map(at, h)?;
        if h != self.zero {
            self.zero_at(at)?;
        }
        Ok(())
    }

    fn zero_at(&self, at: u64) -> Result<(), CudaError> {
        // SAFETY: a mapped granule of ours, written in stream order.
        check("zeroing cache memory", unsafe {
            sys::cuMemsetD8Async(at, 0, self.granule, self.stream.cu_stream())
        })
    }

    /// Room for `slot` to hold `positions` positions: `Ok(false)` when other slots' requests
    /// hold the pool now; an error when the pool could never hold it. Returns the idle slots
    /// whose caches were given away in `evicted`.
    pub fn reserve(
        &mut self,
        slot: usize,
        positions: usize,
        evicted: &mut Vec<usize>,
    ) -> Result<bool, CudaError> {
        let changes = match self.book.reserve(slot, positions) {
            Ok(Some(c)) => c,
            Ok(None) => return Ok(false),
            Err(never) => {
                return Err(CudaError::Model(format!(
                    "{positions} positions of a sequence need {} MB of KV cache, and the pool \
                     holds {} MB (--kv-memory)",
                    (never.needed * self.granule) >> 20,
                    (never.capacity * self.granule) >> 20
                )))
            }
        };
        if changes.changes.is_empty() {
            return Ok(true);
        }
        self.bind()?;
        self.stream
            .synchronize()
            .map_err(driver("before mapping cache memory"))?;
        for c in changes.changes {
            match c {
                Change::Map {
                    slot,
                    range,
                    granule,
                } => {
                    let h = match self.free.pop() {
                        Some(h) => h,
                        None => self.create()?,
                    };
                    self.remap(self.address(slot, range, granule), h)?;
                    let backing = &mut self.backing[slot][range];
                    debug_assert_eq!(backing.len(), granule);
                    backing.push(h);
                }
                Change::Unmap {
                    slot,
                    range,
                    granule,
                } => {
                    let h = self.backing[slot][range]
                        .pop()
                        .expect("the book maps in order");
                    debug_assert_eq!(self.backing[slot][range].len(), granule);
                    self.remap(self.address(slot, range, granule), self.zero)?;
                    self.free.push(h);
                }
            }
        }
        evicted.extend(changes.evicted);
        Ok(true)
    }

    /// `slot`'s request has ended (see [`PageBook::release`]).
    pub fn release(&mut self, slot: usize) {
        if slot < self.slots {
            self.book.release(slot);
        }
    }
}

impl Drop for KvPages {
    fn drop(&mut self) {
        let _ = self.bind();
        let _ = self.stream.synchronize();
        // SAFETY: every range and granule below is ours and no longer used by any kernel.
        unsafe {
            for &(base, part) in &self.bases {
                let _ = sys::cuMemUnmap(base, part * (self.slots + 1));
                let _ = sys::cuMemAddressFree(base, part * (self.slots + 1));
            }
            let held = self.backing.iter().flatten().flatten();
            for &h in held.chain(&self.free).chain(&self.spare) {
                let _ = sys::cuMemRelease(h);
            }
            if self.zero != 0 {
                let _ = sys::cuMemRelease(self.zero);
            }
        }
    }
}

fn location(ordinal: i32) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: ordinal,
    }
}

fn props(ordinal: i32) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
        location: location(ordinal),
        win32HandleMetaData: std::ptr::null_mut(),
        // SAFETY: plain bytes; zero is "no flags".
        allocFlags: unsafe { std::mem::zeroed() },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two ranges: rows of 1 KiB (4 positions a 4 KiB granule) and 2 KiB (2 a granule), 16
    /// positions a slot.
    fn book(slots: usize, capacity: usize) -> PageBook {
        let ranges = vec![
            RangeShape {
                row_bytes: 1024,
                region_granules: 4,
            },
            RangeShape {
                row_bytes: 2048,
                region_granules: 8,
            },
        ];
        PageBook::new(4096, ranges, slots, capacity)
    }

    fn maps(c: &Changes) -> usize {
        c.changes
            .iter()
            .filter(|c| matches!(c, Change::Map { .. }))
            .count()
    }

    #[test]
    fn a_slot_maps_granules_as_it_grows_and_only_the_new_ones() {
        let mut b = book(2, 100);
        let c = b.reserve(0, 3).unwrap().unwrap();
        // 3 positions: one granule of the first range, two of the second.
        assert_eq!(maps(&c), 3);
        assert_eq!(b.held_positions(0), 4);
        let c = b.reserve(0, 4).unwrap().unwrap();
        assert_eq!(c, Changes::default());
        let c = b.reserve(0, 9).unwrap().unwrap();
        assert_eq!(maps(&c), 2 + 3);
        assert_eq!(
            c.changes[0],
            Change::Map {
                slot: 0,
                range: 0,
                granule: 1
            }
        );
        assert_eq!(b.held_positions(0), 10);
        // The whole context caps at the region.
        b.reserve(0, 1000).unwrap().unwrap();
        assert_eq!(b.mapped(0), 12);
        assert_eq!(b.held_positions(0), usize::MAX);
    }

    #[test]
    fn a_request_waits_while_others_hold_the_pool_and_never_fits_beyond_it() {
        let mut b = book(3, 6);
        assert!(b.reserve(0, 4).unwrap().is_some()); // 1 + 2 granules
        assert!(b.reserve(1, 4).unwrap().is_some()); // 3 more: the pool is full
        assert_eq!(b.reserve(2, 1).unwrap(), None);
        assert_eq!(
            b.reserve(2, 100),
            Err(NeverFits {
                needed: 12,
                capacity: 6
            })
        );
        // Slot 0's request ends: slot 2 takes its granules, and slot 0 loses its cache.
        b.release(0);
        let c = b.reserve(2, 4).unwrap().unwrap();
        assert_eq!(c.evicted, vec![0]);
        assert_eq!(b.mapped(0), 0);
        assert_eq!(b.held_positions(0), 0);
        assert_eq!(maps(&c), 3);
        let unmapped = c.changes.len() - maps(&c);
        assert_eq!(unmapped, 3);
        // Every unmap comes before the maps that need its granule.
        assert!(matches!(c.changes[0], Change::Unmap { slot: 0, .. }));
    }

    #[test]
    fn an_idle_cache_stays_until_needed_and_the_longest_idle_goes_first() {
        let mut b = book(4, 9);
        for s in 0..3 {
            b.reserve(s, 4).unwrap().unwrap();
        }
        b.release(1);
        b.release(0);
        // Room is free in the accounting, but no granule: the longest idle (slot 1) goes.
        let c = b.reserve(3, 4).unwrap().unwrap();
        assert_eq!(c.evicted, vec![1]);
        assert_eq!(b.mapped(0), 3);
        // Slot 0 starts a request again: its cache past the new room goes back.
        let c = b.reserve(0, 2).unwrap().unwrap();
        let unmaps: Vec<_> = c
            .changes
            .iter()
            .filter(|c| matches!(c, Change::Unmap { .. }))
            .collect();
        assert_eq!(unmaps.len(), 1);
        assert_eq!(b.mapped(0), 2);
        assert_eq!(b.held_positions(0), 2);
    }

    #[test]
    fn the_books_balance_over_random_requests() {
        let (slots, capacity) = (5, 20);
        let mut b = book(slots, capacity);
        let mut x = 12345u64;
        let mut rand = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % n) as usize
        };
        for _ in 0..2000 {
            let s = rand(slots as u64);
            if rand(4) == 0 {
                b.release(s);
            } else if let Ok(Some(c)) = b.reserve(s, rand(17)) {
                assert!(!c.evicted.contains(&s));
            }
            let mapped: usize = (0..slots).map(|s| b.mapped(s)).sum();
            assert_eq!(mapped + b.free, capacity);
            let reserved: usize = b.reserved.iter().sum();
            assert!(reserved <= capacity);
            for s in 0..slots {
                if b.reserved[s] > 0 {
                    assert!(b.mapped(s) <= b.reserved[s]);
                }
            }
        }
    }
}
