//! Compiles the kernels with NVRTC for `sm_90` (or the architecture given) into the kernel cache
//! (`$FERROLM_HOME/kernels`), on a machine without a GPU: a GPU machine given that cache starts
//! without minutes of compilation. `FERROLM_CUDA_DEFINES` is honoured as the backend honours it.
//!
//! `cargo run --release -p ferrolm-cuda --example compile_kernels [sm_90]`; with `--source` it
//! prints the whole source NVRTC compiles instead (for scripts/kernel-sass.py).

use ferrolm_cuda::kernels;

fn main() {
    if std::env::args().nth(1).as_deref() == Some("--source") {
        print!("{}", *kernels::SOURCE);
        return;
    }
    let arch: &'static str = Box::leak(
        std::env::args()
            .nth(1)
            .unwrap_or_else(|| "sm_90".into())
            .into_boxed_str(),
    );
    let source = kernels::source_with_defines(std::env::var("FERROLM_CUDA_DEFINES").ok());
    let started = std::time::Instant::now();
    match kernels::compile(&source, arch) {
        Ok(cubin) => {
            let dir = kernels::cache_dir();
            kernels::write_cached(&dir, &source, arch, &cubin);
            println!(
                "{} ({:.0} s)",
                dir.join(kernels::cache_file_name(&source, arch)).display(),
                started.elapsed().as_secs_f64()
            );
        }
        Err(e) => {
            eprintln!("the kernels do not compile: {e}");
            std::process::exit(1);
        }
    }
}
