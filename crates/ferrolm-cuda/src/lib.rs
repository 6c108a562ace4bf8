//! ferrolm's CUDA backend: decoding on one NVIDIA GPU, a whole token per CUDA graph launch.
//!
//! Nothing here needs a CUDA toolkit to build: cudarc loads the driver and NVRTC at run time,
//! the kernels are CUDA C compiled by NVRTC at first use for the GPU's own architecture and
//! cached on disk ([`kernels`]). The launch plan of a token ([`schedule`]) is host code that CI
//! tests; [`CudaModel`] uploads the weights in their GGUF block layout, resolves the plan to
//! addresses and captures it into one graph that each token replays. Positions live in device
//! memory, so a replay needs no re-capture and the host reads back only the sampled id (from
//! mapped host memory the step writes, while the next step already runs). On
//! compute capability 9.0 and later the graph's kernels are launched to overlap their
//! predecessors (programmatic dependent launch); each waits for its input inside the kernel.
//!
//! The CPU twin of every path here is the forward pass of `ferrolm-model`; the `ferrolm
//! cuda-check` command compares the two on the same file (on a GPU machine).
// Kernel launches and the disabling of cudarc's event tracking are unsafe calls; each carries
// its reason beside it.
#![deny(missing_docs)]

mod backend;
pub mod batch_device;
pub mod cpu_prompt;
pub mod cpu_tier;
mod device;
pub mod kernels;
mod kv_pages;
pub mod prefill;
pub mod repack;
pub mod schedule;
pub mod slots;
pub mod tiers;
mod tuning;

pub use backend::{device_sampling, open, CudaBackend, CudaOptions, SplitBackend};
pub use device::{device_count, CudaModel, DeviceSampling, Rows, Selections, Stats};
pub use prefill::{RowsWant, TOP_MAX};
pub use schedule::Decline;
pub use tuning::CudaTuning;

/// Why the CUDA path cannot run (or stopped).
#[derive(Debug)]
pub enum CudaError {
    /// No usable CUDA on this machine: no driver library, no device, or no NVRTC.
    NoCuda(String),
    /// The model has a feature (a plan field or a tensor type) the CUDA path does not serve.
    Declined(Decline),
    /// The model needs more device memory than is free.
    OutOfMemory {
        /// Bytes of weights and KV cache.
        needed: u64,
        /// Bytes free on the device.
        free: u64,
    },
    /// The file does not hold what its plan says.
    Model(String),
    /// NVRTC rejected the kernels.
    Compile(String),
    /// A driver call failed.
    Driver(String),
    /// The KV cache is full.
    ContextFull {
        /// Positions it holds.
        n_ctx: usize,
    },
}

impl std::fmt::Display for CudaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CudaError::NoCuda(why) => write!(f, "CUDA is not available: {why}"),
            CudaError::Declined(d) => write!(f, "{d}"),
            CudaError::OutOfMemory { needed, free } => write!(
                f,
                "the model needs {needed} bytes of GPU memory ({:.2} GiB) and {free} are free ({:.2} GiB)",
                *needed as f64 / (1u64 << 30) as f64,
                *free as f64 / (1u64 << 30) as f64
            ),
            CudaError::Model(m) => write!(f, "{m}"),
            CudaError::Compile(m) => write!(f, "compiling the CUDA kernels: {m}"),
            CudaError::Driver(m) => write!(f, "CUDA: {m}"),
            CudaError::ContextFull { n_ctx } => {
                write!(f, "the context of {n_ctx} positions is full")
            }
        }
    }
}

impl std::error::Error for CudaError {}

/// Where a model runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// The CPU forward pass.
    Cpu,
    /// CUDA device N.
    Cuda(usize),
}

impl std::str::FromStr for Device {
    type Err = String;

    /// `cpu`, `cuda` (device 0) or `cuda:N`.
    fn from_str(s: &str) -> Result<Device, String> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" | "gpu" => Ok(Device::Cuda(0)),
            _ => match s.strip_prefix("cuda:") {
                Some(n) => n
                    .parse()
                    .map(Device::Cuda)
                    .map_err(|_| format!("{s:?}: the device number must be a number (cuda:0)")),
                None => Err(format!("{s:?}: the device is cpu, cuda or cuda:N")),
            },
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// The device used when none is asked for: CUDA device 0 when the driver library is present
/// and reports a device, the CPU otherwise (never an error).
pub fn default_device() -> Device {
    match device_count() {
        Ok(n) if n > 0 => Device::Cuda(0),
        _ => Device::Cpu,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse() {
        assert_eq!("cpu".parse(), Ok(Device::Cpu));
        assert_eq!("cuda".parse(), Ok(Device::Cuda(0)));
        assert_eq!("cuda:3".parse(), Ok(Device::Cuda(3)));
        assert!("cuda:x".parse::<Device>().is_err());
        assert!("tpu"
            .parse::<Device>()
            .unwrap_err()
            .contains("cpu, cuda or cuda:N"));
        assert_eq!(Device::Cuda(1).to_string(), "cuda:1");
    }

    #[test]
    fn errors_say_what_is_missing() {
        let e = CudaError::OutOfMemory {
            needed: 3 << 30,
            free: 1 << 30,
        };
        assert!(e.to_string().contains("3.00 GiB"));
        let d = CudaError::Declined(Decline {
            field: "attention.head_dim".into(),
            value: "48".into(),
        });
        assert!(d.to_string().contains("attention.head_dim = 48"));
    }
}

#[cfg(test)]
mod no_cuda_tests {
    use super::*;

    /// On a machine without the driver library (CI), probing is an error, not a panic, and the
    /// default device is the CPU.
    #[test]
    fn without_the_driver_probing_says_so_and_defaults_to_the_cpu() {
        // SAFETY: only tries to open the library.
        if unsafe { cudarc::driver::sys::is_culib_present() } {
            return;
        }
        match device_count() {
            Err(CudaError::NoCuda(why)) => assert!(why.contains("libcuda"), "{why}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(default_device(), Device::Cpu);
    }
}
