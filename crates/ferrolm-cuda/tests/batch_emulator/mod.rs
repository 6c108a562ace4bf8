//! A host [`BatchDevice`] for the batched passes: device addresses stand for host memory
//! (one byte vector per allocation, so a read or write past an allocation's end panics) and a
//! launch runs the kernel's work as host code ([`kernels`]); a graph capture records the
//! launches, and a replay runs them again on what memory holds then (a copy or a wait inside
//! a capture panics, as it would fail one on the device). The weights are the file's rows as
//! the CPU holds them (not regrouped: the products read them with the CPU's own kernels).

pub mod kernels;

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::marker::PhantomData;

use ferrolm_cuda::batch_device::{BatchDevice, Element, Gemm, Value};
use ferrolm_cuda::prefill::Addresses;
use ferrolm_cuda::schedule::{DecodePlan, MixerRefs};
use ferrolm_cuda::CudaError;
use ferrolm_gguf::GgufFile;

/// Host memory at made-up device addresses.
#[derive(Default)]
pub struct Memory {
    allocations: BTreeMap<u64, Vec<u8>>,
    next: u64,
    /// What `quantize_rows_f16` quantized at an address, and for which activation format:
    /// the values themselves (the products quantize them again with the CPU's kernels).
    quantized: BTreeMap<u64, (Vec<f32>, i32)>,
}

impl Memory {
    /// `bytes` zeroed bytes at a new address (never 0, the kernels' "none").
    pub fn alloc(&mut self, bytes: usize) -> u64 {
        let base = self.next.max(1 << 32);
        self.allocations.insert(base, vec![0; bytes]);
        // (a gap after each, so that an address past one's end is in none)
        self.next = (base + bytes as u64 + 4096).next_multiple_of(4096);
        base
    }

    /// The allocation holding `len` bytes from `addr`, and `addr`'s offset in it.
    fn locate(&self, addr: u64, len: usize) -> (u64, usize) {
        let (&base, bytes) = self
            .allocations
            .range(..=addr)
            .next_back()
            .unwrap_or_else(|| panic!("address {addr:#x} is in no allocation"));
        let offset = (addr - base) as usize;
        assert!(
            offset + len <= bytes.len(),
            "{len} bytes at {addr:#x}: past the end of the allocation at {base:#x} ({} bytes)",
            bytes.len()
        );
        (base, offset)
    }

    /// `len` bytes at `addr`.
    pub fn bytes(&self, addr: u64, len: usize) -> &[u8] {
        let (base, at) = self.locate(addr, len);
        &self.allocations[&base][at..at + len]
    }

    /// `len` bytes at `addr`, to write.
    pub fn bytes_mut(&mut self, addr: u64, len: usize) -> &mut [u8] {
        let (base, at) = self.locate(addr, len);
        &mut self.allocations.get_mut(&base).expect("located")[at..at + len]
    }

    /// `n` elements at `addr`.
    pub fn read<T: Element>(&self, addr: u64, n: usize) -> Vec<T> {
        self.bytes(addr, n * T::BYTES)
            .chunks_exact(T::BYTES)
            .map(T::from_le)
            .collect()
    }

    /// `values` at `addr` on.
    pub fn write<T: Element>(&mut self, addr: u64, values: &[T]) {
        let out = self.bytes_mut(addr, values.len() * T::BYTES);
        for (v, o) in values.iter().zip(out.chunks_exact_mut(T::BYTES)) {
            v.to_le(o);
        }
    }

    /// `n` f32s at `addr`.
    pub fn f32s(&self, addr: u64, n: usize) -> Vec<f32> {
        self.read(addr, n)
    }

    /// `n` f16s at `addr`, as f32s.
    pub fn f16s(&self, addr: u64, n: usize) -> Vec<f32> {
        self.read::<u16>(addr, n)
            .into_iter()
            .map(|h| half::f16::from_bits(h).to_f32())
            .collect()
    }

    /// `values` rounded to f16 (to nearest, as the kernels' conversion) at `addr` on.
    pub fn write_f16s(&mut self, addr: u64, values: &[f32]) {
        let h: Vec<u16> = values
            .iter()
            .map(|&v| half::f16::from_f32(v).to_bits())
            .collect();
        self.write(addr, &h);
    }

    /// `n` u32s at `addr`.
    pub fn u32s(&self, addr: u64, n: usize) -> Vec<u32> {
        self.read(addr, n)
    }

    /// `values` quantized for activation format `mode` into the `bytes` at `addr` (which
    /// must lie in an allocation).
    pub fn quantize(&mut self, addr: u64, bytes: usize, values: Vec<f32>, mode: i32) {
        self.locate(addr, bytes);
        self.quantized.insert(addr, (values, mode));
    }

    /// What [`Memory::quantize`] put at `addr`, checked to be in the format rows of type `ty`
    /// multiply.
    pub fn quantized(&self, addr: u64, ty: ferrolm_gguf::TensorType) -> Vec<f32> {
        let (values, mode) = self
            .quantized
            .get(&addr)
            .unwrap_or_else(|| panic!("no quantized activations at {addr:#x}"));
        assert_eq!(
            Some(*mode),
            ferrolm_cuda::schedule::activation_format(ty),
            "activations quantized for another row type"
        );
        values.clone()
    }
}

/// A launch or a GEMM, as a captured graph holds it.
pub enum Op {
    Launch {
        kernel: String,
        grid: (u32, u32),
        block: u32,
        args: Vec<Value>,
    },
    Gemm(Gemm),
}

/// Two arguments of `kernel`'s launches to exchange.
#[derive(Clone, Copy, Debug)]
pub struct Swap {
    pub kernel: &'static str,
    pub args: (usize, usize),
}

/// A buffer of the host device: where it starts and its length.
pub struct HostBuffer<T> {
    addr: u64,
    len: usize,
    _element: PhantomData<T>,
}

/// The batched passes' device on the host: memory (the file's weights in it), the plan, and
/// the kernels launched (by name, in order).
pub struct HostDevice<'f> {
    pub memory: RefCell<Memory>,
    pub plan: &'f DecodePlan,
    /// Each matrix's address: its plan index.
    matrix_at: BTreeMap<u64, usize>,
    pub launched: Vec<String>,
    /// What a capture has recorded so far (`None`: not capturing), and how many times a
    /// captured graph was replayed.
    capture: RefCell<Option<Vec<Op>>>,
    pub replays: Cell<usize>,
    /// The rows of `moe_route` launches whose choice was a near tie, since last taken.
    pub near_ties: RefCell<Vec<usize>>,
    /// A wiring mistake made on purpose: two arguments of a kernel's launches exchanged.
    pub swap: Option<Swap>,
    /// Addresses of everything outside the batch buffers, `slots` sequences (and a spare).
    matrices: Vec<u64>,
    vectors: Vec<u64>,
    k_cache: Vec<u64>,
    v_cache: Vec<u64>,
    /// Each layer's recurrent states (convolution, delta rule) of every slot, and their bytes
    /// a slot.
    states: Vec<[(u64, usize); 2]>,
    /// Each layer's expert counters (0: dense).
    pub expert_counts: Vec<u64>,
    logits: u64,
    token: u64,
    sample_cfg: u64,
}

impl<'f> HostDevice<'f> {
    /// Memory holding `plan`'s matrices (the file's rows, `first_row` on), its vectors (f32),
    /// and caches for `slots` sequences plus a spare, as the CUDA model lays them out.
    pub fn new(file: &'f GgufFile, plan: &'f DecodePlan, slots: usize) -> HostDevice<'f> {
        let mut memory = Memory::default();
        let mut matrix_at = BTreeMap::new();
        let mut matrices = Vec::new();
        for (m, spec) in plan.matrices.iter().enumerate() {
            let data = spec.bytes(file.file_bytes()).expect("the plan's rows");
            let addr = memory.alloc(data.len());
            memory.bytes_mut(addr, data.len()).copy_from_slice(&data);
            matrix_at.insert(addr, m);
            matrices.push(addr);
        }
        let mut vectors = Vec::new();
        for v in &plan.vectors {
            let addr = memory.alloc(4 * v.len());
            memory.write(addr, &v.values);
            vectors.push(addr);
        }
        let cache = |memory: &mut Memory| -> Vec<u64> {
            plan.kv_dims
                .iter()
                .map(|&kv| memory.alloc(2 * (slots + 1) * plan.n_ctx * kv))
                .collect()
        };
        let (k_cache, v_cache) = (cache(&mut memory), cache(&mut memory));
        let states = plan
            .layers
            .iter()
            .map(|r| {
                let [conv, ssm] = match &r.mixer {
                    MixerRefs::DeltaNet(d) => [d.conv_state(), d.ssm_state()],
                    MixerRefs::Attention(_) => [0, 0],
                };
                [conv, ssm].map(|n| (memory.alloc(4 * n * (slots + 1)), 4 * n))
            })
            .collect();
        let expert_counts = plan
            .layers
            .iter()
            .map(|r| r.moe.as_ref().map_or(0, |m| memory.alloc(4 * m.n_expert)))
            .collect();
        let logits = memory.alloc(4 * plan.n_vocab);
        let token = memory.alloc(4);
        // (zeros: k = 0, greedy)
        let sample_cfg = memory.alloc(64);
        HostDevice {
            memory: RefCell::new(memory),
            plan,
            matrix_at,
            launched: Vec::new(),
            capture: RefCell::new(None),
            replays: Cell::new(0),
            near_ties: RefCell::new(Vec::new()),
            swap: None,
            matrices,
            vectors,
            k_cache,
            v_cache,
            states,
            expert_counts,
            logits,
            token,
            sample_cfg,
        }
    }

    /// The addresses the passes read for `slot` (its caches), as `CudaModel` gives them.
    pub fn addresses(&self, slot: usize) -> Addresses {
        let offset = |base: &[u64]| -> Vec<u64> {
            base.iter()
                .zip(self.slot_stride())
                .map(|(&b, stride)| b + (2 * slot * stride) as u64)
                .collect()
        };
        Addresses {
            matrices: self.matrices.clone(),
            vectors: self.vectors.clone(),
            k_cache: offset(&self.k_cache),
            v_cache: offset(&self.v_cache),
            states: self
                .states
                .iter()
                .map(|st| {
                    st.map(|(base, bytes)| {
                        if bytes == 0 {
                            0
                        } else {
                            base + (slot * bytes) as u64
                        }
                    })
                })
                .collect(),
            expert_counts: self.expert_counts.clone(),
            logits: self.logits,
            token: self.token,
            sampling: [self.sample_cfg, 0, 0],
        }
    }

    /// Halfs between one slot's cache and the next's, per layer.
    pub fn slot_stride(&self) -> Vec<usize> {
        self.plan
            .kv_dims
            .iter()
            .map(|&kv| self.plan.n_ctx * kv)
            .collect()
    }

    /// Runs `op` on the memory.
    fn execute(&self, op: &Op) {
        match op {
            Op::Launch {
                kernel,
                grid,
                block,
                args,
            } => kernels::run(self, kernel, *grid, *block, args),
            Op::Gemm(g) => kernels::gemm(&mut self.memory.borrow_mut(), *g),
        }
    }

    /// Runs `op`, or records it while a capture is on (a captured graph reads its inputs
    /// from memory when it is replayed, not when it is captured).
    fn submit(&mut self, name: &str, op: Op) {
        self.launched.push(name.to_string());
        match self.capture.get_mut() {
            Some(ops) => ops.push(op),
            None => self.execute(&op),
        }
    }

    /// Copies and waits are not captured (on the device they would fail the capture).
    fn not_capturing(&self, what: &str) {
        assert!(self.capture.borrow().is_none(), "{what} during a capture");
    }

    /// The matrix at `addr` and the row `addr` points to.
    pub fn matrix(&self, addr: u64) -> (usize, usize) {
        let (&base, &m) = self
            .matrix_at
            .range(..=addr)
            .next_back()
            .unwrap_or_else(|| panic!("{addr:#x} is not in a matrix"));
        let spec = &self.plan.matrices[m];
        let (rb, offset) = (spec.row_bytes() as u64, addr - base);
        assert!(
            offset < spec.rows as u64 * rb,
            "{addr:#x} is not in a matrix"
        );
        assert_eq!(offset % rb, 0, "{addr:#x} is not at a row's start");
        (m, (offset / rb) as usize)
    }
}

impl BatchDevice for HostDevice<'_> {
    type Buffer<T: Element> = HostBuffer<T>;
    type Graph = Vec<Op>;

    fn alloc_zeros<T: Element>(&self, n: usize, _: &str) -> Result<HostBuffer<T>, CudaError> {
        let addr = self.memory.borrow_mut().alloc(n * T::BYTES);
        Ok(HostBuffer {
            addr,
            len: n,
            _element: PhantomData,
        })
    }

    fn address<T: Element>(&self, buf: &HostBuffer<T>) -> u64 {
        buf.addr
    }

    fn upload_at<T: Element>(
        &self,
        src: &[T],
        dst: &mut HostBuffer<T>,
        at: usize,
        _: &str,
    ) -> Result<(), CudaError> {
        self.not_capturing("an upload");
        assert!(at + src.len() <= dst.len, "an upload past the buffer's end");
        let addr = dst.addr + (at * T::BYTES) as u64;
        self.memory.borrow_mut().write(addr, src);
        Ok(())
    }

    fn download<T: Element>(
        &self,
        src: &HostBuffer<T>,
        dst: &mut [T],
        _: &str,
    ) -> Result<(), CudaError> {
        self.not_capturing("a download");
        assert!(dst.len() <= src.len, "a download past the buffer's end");
        dst.copy_from_slice(&self.memory.borrow().read(src.addr, dst.len()));
        Ok(())
    }

    fn synchronize(&self, what: &str) -> Result<(), CudaError> {
        self.not_capturing(what);
        Ok(())
    }

    fn idle(&self) -> Result<bool, CudaError> {
        // (every launch ran when it was made)
        Ok(true)
    }

    fn launch_shared(
        &mut self,
        kernel: &str,
        grid: (u32, u32),
        block: u32,
        _shared: u32,
        args: &[Value],
    ) -> Result<(), CudaError> {
        assert_parameters(kernel, args);
        let mut args = args.to_vec();
        if let Some(swap) = self.swap.filter(|s| s.kernel == kernel) {
            args.swap(swap.args.0, swap.args.1);
        }
        let op = Op::Launch {
            kernel: kernel.to_string(),
            grid,
            block,
            args,
        };
        self.submit(kernel, op);
        Ok(())
    }

    fn gemm(&mut self, g: Gemm) -> Result<(), CudaError> {
        let name = if g.batch > 1 { "gemm batched" } else { "gemm" };
        self.submit(name, Op::Gemm(g));
        Ok(())
    }

    fn begin_capture(&self) -> Result<(), CudaError> {
        let was = self.capture.borrow_mut().replace(Vec::new());
        assert!(was.is_none(), "a capture inside a capture");
        Ok(())
    }

    fn end_capture(&self) -> Result<Option<Vec<Op>>, CudaError> {
        let ops = self.capture.borrow_mut().take().expect("a capture begun");
        Ok((!ops.is_empty()).then_some(ops))
    }

    fn upload_graph(&self, _: &Vec<Op>) -> Result<(), CudaError> {
        Ok(())
    }

    fn launch_graph(&self, graph: &Vec<Op>) -> Result<(), CudaError> {
        self.not_capturing("a replay");
        self.replays.set(self.replays.get() + 1);
        graph.iter().for_each(|op| self.execute(op));
        Ok(())
    }

    fn profiling(&self) -> bool {
        false
    }

    fn set_profile(&mut self, _: bool) -> Result<Vec<(String, usize, f64)>, CudaError> {
        Ok(Vec::new())
    }
}

/// A launch passes as many arguments as its kernel declares in the source, each of the declared
/// kind: on a GPU a missing or extra one shifts the others silently.
fn assert_parameters(kernel: &str, args: &[Value]) {
    use crate::kernel_source::{self, Kernel, Param};
    static KERNELS: std::sync::OnceLock<Vec<Kernel>> = std::sync::OnceLock::new();
    let all = KERNELS.get_or_init(kernel_source::kernels);
    let fits = |k: &&Kernel| {
        let params = k.parameters();
        params.len() == args.len()
            && args.iter().zip(&params).all(|(a, p)| {
                matches!(
                    (a, p),
                    (Value::Ptr(_), Param::Pointer)
                        | (Value::I32(_), Param::Int)
                        | (Value::F32(_), Param::Float)
                        | (Value::I64(_), Param::Long)
                )
            })
    };
    let defs = kernel_source::definitions(all, kernel);
    assert!(defs.iter().any(fits), "{kernel}: {args:?}");
}
