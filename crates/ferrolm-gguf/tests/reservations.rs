//! A hostile header's counts do not make the reader reserve more memory than the file holds:
//! every count is checked against the bytes left, and at most a few thousand entries are
//! reserved before they are parsed. Its own test binary, for its counting allocator.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

/// The system allocator, counting live bytes and their peak.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; only counters are added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let live = LIVE.fetch_add(layout.size(), SeqCst) + layout.size();
        PEAK.fetch_max(live, SeqCst);
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), SeqCst);
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// A version-3 header claiming `n_tensors` tensors and no metadata, then zeros: each 24 zero
/// bytes read as a tensor with an empty name, so the second one is a duplicate.
fn header(n_tensors: u64, len: usize) -> Vec<u8> {
    let mut b = Vec::with_capacity(len);
    b.extend_from_slice(b"GGUF");
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&n_tensors.to_le_bytes());
    b.extend_from_slice(&0u64.to_le_bytes());
    b.resize(len, 0);
    b
}

#[test]
fn a_huge_tensor_count_reserves_no_more_than_the_file_holds() {
    let len = 4 << 20;
    let n_tensors = (len as u64 - 24) / 24;
    let bytes = header(n_tensors, len);
    let before = LIVE.load(SeqCst);
    PEAK.store(before, SeqCst);
    let result = ferrolm_gguf::GgufFile::from_bytes(bytes);
    assert!(result.is_err(), "a duplicate empty name is an error");
    drop(result);
    // The file's own bytes are counted in `before`; what parsing added on top stays small.
    let added = PEAK.load(SeqCst) - before;
    assert!(
        added < len / 4,
        "parsing reserved {added} bytes for a {len}-byte file"
    );
}
