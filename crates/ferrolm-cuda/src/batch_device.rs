//! What the batched passes ([`crate::prefill::Prefill`]) ask of a device: buffers, copies to
//! and from them, kernel launches by name, cuBLAS's GEMM and graph capture.
//!
//! [`CudaBatch`] is the GPU: each method is the driver or cuBLAS call the batched passes made
//! directly before this trait existed, in the same order. A test implements the trait on the
//! host (`tests/emulated_batches.rs`): device addresses stand for host memory and a launch runs
//! host code, so that the passes' wiring (which kernels, on which buffers, with which sizes)
//! is checked without a GPU.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::cublas::{result as blas, sys as blas_sys, CudaBlas};
use cudarc::driver::{
    sys, CudaEvent, CudaFunction, CudaGraph, CudaModule, CudaSlice, CudaStream, DevicePtr,
    DeviceRepr, LaunchConfig, ValidAsZeroBits,
};

use crate::device::{driver, launch, launch_overlapped};
use crate::CudaError;

pub use crate::device::Value;

/// An element type of the batched passes' buffers (f32, u32, and f16 as its bits in a u16),
/// with its little-endian bytes (for a host implementation's memory).
pub trait Element: DeviceRepr + ValidAsZeroBits + Copy + Unpin + 'static {
    /// Bytes of one element.
    const BYTES: usize;
    /// The element from its `BYTES` little-endian bytes.
    fn from_le(bytes: &[u8]) -> Self;
    /// Its little-endian bytes into `out` (`BYTES` long).
    fn to_le(self, out: &mut [u8]);
}

macro_rules! element {
    ($($t:ty),*) => {$(
        impl Element for $t {
            const BYTES: usize = std::mem::size_of::<$t>();
            fn from_le(bytes: &[u8]) -> Self {
                <$t>::from_le_bytes(bytes.try_into().expect("one element's bytes"))
            }
            fn to_le(self, out: &mut [u8]) {
                out.copy_from_slice(&self.to_le_bytes());
            }
        }
    )*};
}
element!(u16, u32, f32);

/// A GEMM: `c[t][r] = a[t] . w[r] (+ beta * c[t][r])` for the `n` rows `t` of `a` (f16,
/// `cols` wide) and the `rows` rows of `w16` (f16); `c` is f32, `rows` wide. Addresses.
#[derive(Clone, Copy, Debug)]
pub struct Gemm {
    /// The weights.
    pub w16: u64,
    /// Their rows (the outputs per input row).
    pub rows: usize,
    /// Their columns (the inputs' width).
    pub cols: usize,
    /// The inputs.
    pub a: u64,
    /// Input rows.
    pub n: usize,
    /// The outputs.
    pub c: u64,
    /// What the outputs keep of their values before (0: overwritten, 1: added to).
    pub beta: f32,
    /// The weights and inputs are f32 (the router's product, whose top-k an f16 rounding of
    /// its input can change), not f16.
    pub f32_operands: bool,
    /// GEMMs of this shape one after another in memory (1: one): the `i`-th reads the weights
    /// `i * rows * cols` halfs on, the inputs `i * n * cols` halfs on and writes the outputs
    /// `i * n * rows` floats on (each expert of a stacked tensor over its group's rows).
    pub batch: usize,
}

/// The device operations of the batched passes. Addresses are the `u64`s kernels take: a
/// buffer's start plus a byte offset.
pub trait BatchDevice {
    /// A buffer of `T`s in device memory.
    type Buffer<T: Element>;
    /// A captured sequence of launches, replayed whole.
    type Graph;

    /// `n` zeroed elements (`what` names them in an error).
    fn alloc_zeros<T: Element>(&self, n: usize, what: &str) -> Result<Self::Buffer<T>, CudaError>;
    /// The buffer's device address.
    fn address<T: Element>(&self, buf: &Self::Buffer<T>) -> u64;
    /// The first `src.len()` elements of `dst` = `src`.
    fn upload<T: Element>(
        &self,
        src: &[T],
        dst: &mut Self::Buffer<T>,
        what: &str,
    ) -> Result<(), CudaError> {
        self.upload_at(src, dst, 0, what)
    }
    /// Elements `at..at + src.len()` of `dst` = `src`.
    fn upload_at<T: Element>(
        &self,
        src: &[T],
        dst: &mut Self::Buffer<T>,
        at: usize,
        what: &str,
    ) -> Result<(), CudaError>;
    /// `dst` = the first `dst.len()` elements of `src`.
    fn download<T: Element>(
        &self,
        src: &Self::Buffer<T>,
        dst: &mut [T],
        what: &str,
    ) -> Result<(), CudaError>;
    /// Waits for everything queued.
    fn synchronize(&self, what: &str) -> Result<(), CudaError>;
    /// Whether everything queued so far has finished, without waiting.
    fn idle(&self) -> Result<bool, CudaError>;
    /// Launches `kernel` on a grid of `grid` blocks of `block` threads with `args` (in the
    /// kernel's parameter order).
    fn launch(
        &mut self,
        kernel: &str,
        grid: (u32, u32),
        block: u32,
        args: &[Value],
    ) -> Result<(), CudaError> {
        self.launch_shared(kernel, grid, block, 0, args)
    }
    /// [`BatchDevice::launch`] with `shared` bytes of dynamic shared memory a block.
    fn launch_shared(
        &mut self,
        kernel: &str,
        grid: (u32, u32),
        block: u32,
        shared: u32,
        args: &[Value],
    ) -> Result<(), CudaError>;
    /// Runs a GEMM.
    fn gemm(&mut self, g: Gemm) -> Result<(), CudaError>;
    /// Starts capturing the launches that follow into a graph.
    fn begin_capture(&self) -> Result<(), CudaError>;
    /// Ends the capture: its graph, or `None` when nothing was captured.
    fn end_capture(&self) -> Result<Option<Self::Graph>, CudaError>;
    /// Uploads a captured graph ahead of its first launch.
    fn upload_graph(&self, graph: &Self::Graph) -> Result<(), CudaError>;
    /// Replays a captured graph.
    fn launch_graph(&self, graph: &Self::Graph) -> Result<(), CudaError>;
    /// Whether launches are being timed ([`BatchDevice::set_profile`]).
    fn profiling(&self) -> bool;
    /// Starts (or stops and returns) timing each launch: microseconds per kernel name,
    /// slowest first.
    fn set_profile(&mut self, on: bool) -> Result<Vec<(String, usize, f64)>, CudaError>;
}

/// The GPU: a stream, its cuBLAS handle and the compiled kernels.
pub struct CudaBatch {
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    module: Arc<CudaModule>,
    funcs: HashMap<String, CudaFunction>,
    /// Events around each launch, when profiling.
    profile: Option<Vec<(String, CudaEvent, CudaEvent)>>,
    /// GEMMs of at most this many input rows run `skinny_gemm`, not cuBLAS
    /// ([`crate::CudaTuning::skinny_gemm_max_rows`]).
    skinny_max_rows: usize,
    /// The kernels allowed more than 48 KiB of dynamic shared memory, and how much.
    wide_shared: HashMap<String, u32>,
    /// Kernels launched to overlap their predecessors ([`crate::CudaTuning::batch_overlap`];
    /// each waits for its input itself), except while profiling.
    overlap: bool,
}

/// Weight rows of a `skinny_gemm` or `dq4k_gemm` block (the kernels' `SG_ROWS`), its threads
/// (`SG_WARPS` warps) and the most input rows they take (two m16n8k16 tiles' 16).
pub const SKINNY_BLOCK_ROWS: usize = 32;
pub(crate) const SKINNY_THREADS: u32 = 256;
pub(crate) const SKINNY_MOST_ROWS: usize = 16;

impl CudaBatch {
    /// `stream`'s device with a new cuBLAS handle, or `None` when cuBLAS is not on this
    /// machine.
    pub(crate) fn new(
        stream: &Arc<CudaStream>,
        module: &Arc<CudaModule>,
        skinny_max_rows: usize,
        overlap: bool,
    ) -> Result<Option<CudaBatch>, CudaError> {
        // SAFETY: only tries to open the library by its usual names.
        if !unsafe { blas_sys::is_culib_present() } {
            return Ok(None);
        }
        let blas = CudaBlas::new(stream.clone())
            .map_err(|e| CudaError::Driver(format!("creating the cuBLAS handle: {e}")))?;
        let mut dev = CudaBatch {
            stream: stream.clone(),
            blas,
            module: module.clone(),
            funcs: HashMap::new(),
            profile: None,
            skinny_max_rows: skinny_max_rows.min(SKINNY_MOST_ROWS),
            wide_shared: HashMap::new(),
            overlap,
        };
        // Past 48 KiB a kernel must be allowed its dynamic shared memory first: here, before
        // any graph capture (which may refuse the call). A device with less shared memory
        // refuses some layouts: those then fail when launched, the others still run.
        use crate::prefill::{dq_pipe_shared, DQ4K_STAGE_ROW, DQ6K_STAGE_ROW, DQ6_PIPE, DQ_PIPES};
        let (w6, s6) = DQ6_PIPE;
        for tiles in [1, 2] {
            let most = 8 * tiles;
            let q6 = (
                format!("dq6k_pipe_{most}"),
                dq_pipe_shared(DQ6K_STAGE_ROW, w6, s6, tiles),
            );
            let q4 = DQ_PIPES.map(|(w, s)| {
                let name = format!("dq4k_pipe_{most}_{w}x{s}");
                (name, dq_pipe_shared(DQ4K_STAGE_ROW, w, s, tiles))
            });
            for (name, bytes) in q4.into_iter().chain([q6]) {
                let allowed = dev.func(&name)?.set_attribute(
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes as i32,
                );
                if allowed.is_ok() {
                    dev.wide_shared.insert(name, bytes);
                }
            }
        }
        Ok(Some(dev))
    }

    fn func(&mut self, name: &str) -> Result<CudaFunction, CudaError> {
        if let Some(f) = self.funcs.get(name) {
            return Ok(f.clone());
        }
        let f = self.module.load_function(name).map_err(driver(name))?;
        self.funcs.insert(name.to_string(), f.clone());
        Ok(f)
    }

    /// Whether `skinny_gemm` serves `g`: few input rows, whole 32-column chunks, and rows
    /// that start on 16-byte boundaries (its loads' width).
    fn skinny_fits(&self, g: &Gemm) -> bool {
        g.n <= self.skinny_max_rows
            && g.cols.is_multiple_of(32)
            && g.rows > 0
            && (g.w16 | g.a).is_multiple_of(16)
            && i32::try_from(g.rows).is_ok()
            && i32::try_from(g.cols).is_ok()
    }

    /// A GEMM of few input rows by `skinny_gemm` (ARCHITECTURE.md: "Batched decode").
    fn skinny_gemm(&mut self, g: Gemm) -> Result<(), CudaError> {
        // One tile of 8 inputs where they fit, else two.
        let kernel = if g.n <= 8 {
            "skinny_gemm_8"
        } else {
            "skinny_gemm_16"
        };
        self.launch(
            kernel,
            (g.rows.div_ceil(SKINNY_BLOCK_ROWS) as u32, 1),
            SKINNY_THREADS,
            &[
                Value::Ptr(g.w16),
                Value::Ptr(g.a),
                Value::Ptr(g.c),
                Value::I32(g.rows as i32),
                Value::I32(g.cols as i32),
                Value::I32(g.n as i32),
                Value::F32(g.beta),
            ],
        )
    }

    /// An event before a launch, when profiling.
    fn mark(&self) -> Result<Option<CudaEvent>, CudaError> {
        if self.profile.is_none() {
            return Ok(None);
        }
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        self.stream
            .record_event(flags)
            .map(Some)
            .map_err(driver("event"))
    }

    /// Files the time since `start` under `name`, when profiling.
    fn record(&mut self, name: &str, start: Option<CudaEvent>) -> Result<(), CudaError> {
        if let Some(start) = start {
            let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
            let end = self.stream.record_event(flags).map_err(driver("event"))?;
            let base = name.split("_Q").next().unwrap_or(name);
            if let Some(p) = self.profile.as_mut() {
                p.push((base.to_string(), start, end));
            }
        }
        Ok(())
    }
}

impl BatchDevice for CudaBatch {
    type Buffer<T: Element> = CudaSlice<T>;
    type Graph = CudaGraph;

    fn alloc_zeros<T: Element>(&self, n: usize, what: &str) -> Result<CudaSlice<T>, CudaError> {
        self.stream.alloc_zeros::<T>(n).map_err(driver(what))
    }

    fn address<T: Element>(&self, buf: &CudaSlice<T>) -> u64 {
        buf.device_ptr(&self.stream).0
    }

    fn upload_at<T: Element>(
        &self,
        src: &[T],
        dst: &mut CudaSlice<T>,
        at: usize,
        what: &str,
    ) -> Result<(), CudaError> {
        self.stream
            .memcpy_htod(src, &mut dst.slice_mut(at..at + src.len()))
            .map_err(driver(what))
    }

    fn download<T: Element>(
        &self,
        src: &CudaSlice<T>,
        dst: &mut [T],
        what: &str,
    ) -> Result<(), CudaError> {
        self.stream
            .memcpy_dtoh(&src.slice(..dst.len()), dst)
            .map_err(driver(what))
    }

    fn synchronize(&self, what: &str) -> Result<(), CudaError> {
        self.stream.synchronize().map_err(driver(what))
    }

    fn idle(&self) -> Result<bool, CudaError> {
        let flags = Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING);
        let event = self.stream.record_event(flags).map_err(driver("event"))?;
        Ok(event.is_complete())
    }

    fn launch_shared(
        &mut self,
        kernel: &str,
        grid: (u32, u32),
        block: u32,
        shared: u32,
        args: &[Value],
    ) -> Result<(), CudaError> {
        let f = self.func(kernel)?;
        if shared > self.wide_shared.get(kernel).copied().unwrap_or(48 << 10) {
            return Err(CudaError::Driver(format!(
                "{kernel} was not allowed {shared} bytes of shared memory"
            )));
        }
        let cfg = LaunchConfig {
            grid_dim: (grid.0, grid.1, 1),
            block_dim: (block, 1, 1),
            shared_mem_bytes: shared,
        };
        let start = self.mark()?;
        if self.overlap && self.profile.is_none() {
            launch_overlapped(&self.stream, &f, cfg, args)?;
        } else {
            launch(&self.stream, &f, cfg, args)?;
        }
        self.record(kernel, start)
    }

    fn gemm(&mut self, g: Gemm) -> Result<(), CudaError> {
        let Gemm {
            w16,
            rows,
            cols,
            a,
            n,
            c,
            beta,
            f32_operands,
            batch,
        } = g;
        let alpha = 1f32;
        let operands = if f32_operands {
            blas_sys::cudaDataType::CUDA_R_32F
        } else {
            blas_sys::cudaDataType::CUDA_R_16F
        };
        if batch == 1 && !f32_operands && self.skinny_fits(&g) {
            return self.skinny_gemm(g);
        }
        let start = self.mark()?;
        if batch > 1 {
            assert!(!f32_operands, "batched GEMMs read f16 operands");
            // SAFETY: as below, each of the `batch` GEMMs within the buffers' sizes.
            unsafe {
                blas::gemm_strided_batched_ex(
                    *self.blas.handle(),
                    blas_sys::cublasOperation_t::CUBLAS_OP_T,
                    blas_sys::cublasOperation_t::CUBLAS_OP_N,
                    rows as i32,
                    n as i32,
                    cols as i32,
                    (&alpha as *const f32).cast(),
                    w16 as *const std::ffi::c_void,
                    operands,
                    cols as i32,
                    (rows * cols) as i64,
                    a as *const std::ffi::c_void,
                    operands,
                    cols as i32,
                    (n * cols) as i64,
                    (&beta as *const f32).cast(),
                    c as *mut std::ffi::c_void,
                    blas_sys::cudaDataType::CUDA_R_32F,
                    rows as i32,
                    (n * rows) as i64,
                    batch as i32,
                    blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .map_err(|e| {
                CudaError::Driver(format!("cuBLAS GEMMs {batch} x {rows}x{cols}x{n}: {e}"))
            })?;
            return self.record("gemm batched (cuBLAS)", start);
        }
        // Column-major view: C (rows x n) = W^T-stored (cols x rows)^T * A (cols x n).
        // SAFETY: the pointers are live device buffers of at least these sizes (allocated
        // from the same plan); alpha and beta are host values read during the call.
        unsafe {
            blas::gemm_ex(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                rows as i32,
                n as i32,
                cols as i32,
                (&alpha as *const f32).cast(),
                w16 as *const std::ffi::c_void,
                operands,
                cols as i32,
                a as *const std::ffi::c_void,
                operands,
                cols as i32,
                (&beta as *const f32).cast(),
                c as *mut std::ffi::c_void,
                blas_sys::cudaDataType::CUDA_R_32F,
                rows as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| CudaError::Driver(format!("cuBLAS GEMM {rows}x{cols}x{n}: {e}")))?;
        self.record("gemm (cuBLAS)", start)
    }

    fn begin_capture(&self) -> Result<(), CudaError> {
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(driver("beginning the capture"))
    }

    fn end_capture(&self) -> Result<Option<CudaGraph>, CudaError> {
        self.stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(driver("ending the capture"))
    }

    fn upload_graph(&self, graph: &CudaGraph) -> Result<(), CudaError> {
        graph.upload().map_err(driver("uploading the graph"))
    }

    fn launch_graph(&self, graph: &CudaGraph) -> Result<(), CudaError> {
        graph.launch().map_err(driver("launching the batched step"))
    }

    fn profiling(&self) -> bool {
        self.profile.is_some()
    }

    fn set_profile(&mut self, on: bool) -> Result<Vec<(String, usize, f64)>, CudaError> {
        let events = std::mem::replace(&mut self.profile, on.then(Vec::new));
        let mut per: HashMap<String, (usize, f64)> = HashMap::new();
        if let Some(events) = events {
            self.stream.synchronize().map_err(driver("profiling"))?;
            for (name, start, end) in events {
                let ms = start.elapsed_ms(&end).map_err(driver("event time"))?;
                let e = per.entry(name).or_default();
                e.0 += 1;
                e.1 += f64::from(ms) * 1e3;
            }
        }
        let mut out: Vec<_> = per.into_iter().map(|(k, (n, us))| (k, n, us)).collect();
        out.sort_by(|a, b| b.2.total_cmp(&a.2));
        Ok(out)
    }
}
