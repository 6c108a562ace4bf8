//! The CUDA C source of the kernels and the on-disk cache of what NVRTC makes of it.
//!
//! The cache key is a hash of the source and the target architecture, so a changed kernel or a
//! different GPU never loads stale code; the cache lives under `$FERROLM_HOME/kernels/`.

use std::path::{Path, PathBuf};
use std::sync::LazyLock;

/// The kernels, CUDA C (no headers: NVRTC compiles it as is): kernels.cu with the i-quant
/// block types of kernels_iquants.cu at its `@IQUANTS` line, after the lattice tables they
/// read, rendered from ferrolm-quant's (the CPU's own), and the hybrid models' layers of
/// kernels_delta_net.cu at its end.
pub static SOURCE: LazyLock<String> = LazyLock::new(|| {
    let main = include_str!("kernels.cu");
    let at = main
        .find("// @IQUANTS")
        .expect("kernels.cu marks where the i-quants go");
    let mut s = String::with_capacity(main.len() + (1 << 17));
    s.push_str(&main[..at]);
    s.push_str(&ferrolm_quant::lattice_tables_c());
    s.push('\n');
    s.push_str(include_str!("kernels_iquants.cu"));
    s.push('\n');
    s.push_str(&main[at..]);
    s.push('\n');
    s.push_str(include_str!("kernels_delta_net.cu"));
    s
});

/// [`SOURCE`] after a `#define` line for each comma-separated `NAME` or `NAME=VALUE` of
/// `defines` (`FERROLM_CUDA_DEFINES`: kernel variants compared on the GPU machine without a
/// rebuild; the cache key follows the text).
pub fn source_with_defines(defines: Option<String>) -> String {
    let mut out = String::new();
    for d in defines.iter().flat_map(|d| d.split(',')) {
        let d = d.trim();
        if d.is_empty() {
            continue;
        }
        let (name, value) = d.split_once('=').unwrap_or((d, ""));
        out.push_str(&format!("#define {} {}\n", name.trim(), value.trim()));
    }
    out.push_str(&SOURCE);
    out
}

/// `source` compiled by NVRTC for `arch` (`sm_90`) into machine code (a CUBIN), as the device
/// loads it (needs the NVRTC library only, no GPU). Machine code rather than PTX: the driver
/// would otherwise compile the PTX again at every load on a machine it has not cached it on,
/// which for this source takes minutes.
pub fn compile(source: &str, arch: &str) -> Result<Vec<u8>, String> {
    use cudarc::nvrtc::{result, sys};
    let src = std::ffi::CString::new(source).map_err(|_| "a NUL byte in the source")?;
    let prog = result::create_program(&src, None).map_err(|e| e.to_string())?;
    let options = [format!("--gpu-architecture={arch}"), "-std=c++17".into()];
    // SAFETY: `prog` was created above and is destroyed once, at the end; the buffers handed
    // to NVRTC are as long as the sizes it reported.
    unsafe {
        let compiled = result::compile_program(prog, &options).map_err(|e| {
            let log = result::get_program_log(prog).unwrap_or_default();
            let log: Vec<u8> = log
                .iter()
                .map(|&c| c as u8)
                .take_while(|&b| b != 0)
                .collect();
            format!("{e}: {}", String::from_utf8_lossy(&log))
        });
        let cubin = compiled.and_then(|()| {
            let mut size = 0usize;
            sys::nvrtcGetCUBINSize(prog, &mut size)
                .result()
                .map_err(|e| e.to_string())?;
            let mut bytes = vec![0u8; size];
            sys::nvrtcGetCUBIN(prog, bytes.as_mut_ptr().cast())
                .result()
                .map_err(|e| e.to_string())?;
            Ok(bytes)
        });
        let _ = result::destroy_program(prog);
        cubin
    }
}

/// FNV-1a, 64 bits: stable across Rust versions and platforms (unlike `DefaultHasher`).
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The architecture NVRTC targets for compute capability `major.minor` (`sm_90`).
pub fn arch_name(major: i32, minor: i32) -> String {
    format!("sm_{major}{minor}")
}

/// The cache file name of `source` compiled for `arch`: `<16 hex digits of the hash>-<arch>.cubin`.
pub fn cache_file_name(source: &str, arch: &str) -> String {
    let mut keyed = Vec::with_capacity(source.len() + arch.len() + 1);
    keyed.extend_from_slice(source.as_bytes());
    keyed.push(0);
    keyed.extend_from_slice(arch.as_bytes());
    format!("{:016x}-{arch}.cubin", fnv1a64(&keyed))
}

/// `$FERROLM_HOME/kernels`, or `~/.cache/ferrolm/kernels`.
pub fn cache_dir() -> PathBuf {
    let home = std::env::var_os("FERROLM_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            std::env::var_os("HOME")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from("."))
                .join(".cache")
                .join("ferrolm")
        });
    home.join("kernels")
}

/// Reads a cached compilation, if present and not empty.
pub fn read_cached(dir: &Path, source: &str, arch: &str) -> Option<Vec<u8>> {
    let bytes = std::fs::read(dir.join(cache_file_name(source, arch))).ok()?;
    (!bytes.is_empty()).then_some(bytes)
}

/// Writes a compilation to the cache (atomically: a temporary file renamed into place, so that
/// a concurrent reader never sees half a file). Failures only cost a recompilation next time.
pub fn write_cached(dir: &Path, source: &str, arch: &str, code: &[u8]) {
    let name = cache_file_name(source, arch);
    let tmp = dir.join(format!("{name}.{}.tmp", std::process::id()));
    let ok = std::fs::create_dir_all(dir).is_ok()
        && std::fs::write(&tmp, code).is_ok()
        && std::fs::rename(&tmp, dir.join(&name)).is_ok();
    if !ok {
        let _ = std::fs::remove_file(&tmp);
    }
}

#[cfg(test)]
mod tests {
    /// The kernels compile for the H100/H200's sm_90 wherever NVRTC is on the machine (CI
    /// installs it: scripts/test; FERROLM_REQUIRE_NVRTC makes its absence a failure).
    #[test]
    fn the_kernels_compile_with_nvrtc() {
        // SAFETY: only tries to open the library by its usual names.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            assert!(
                std::env::var_os("FERROLM_REQUIRE_NVRTC").is_none(),
                "FERROLM_REQUIRE_NVRTC is set and libnvrtc was not found"
            );
            eprintln!("skipped: libnvrtc is not on this machine");
            return;
        }
        match super::compile(&super::source_with_defines(None), "sm_90") {
            // (machine code: an ELF image)
            Ok(cubin) => assert!(cubin.starts_with(b"\x7fELF"), "not a CUBIN"),
            Err(e) => panic!("the kernels do not compile: {e}"),
        }
    }

    use super::*;

    #[test]
    fn fnv_matches_its_reference_values() {
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x85944171f73967e8);
    }

    #[test]
    fn the_key_changes_with_source_and_architecture() {
        let a = cache_file_name("kernel", "sm_90");
        assert_eq!(a, cache_file_name("kernel", "sm_90"));
        assert_ne!(a, cache_file_name("kernel ", "sm_90"));
        assert_ne!(a, cache_file_name("kernel", "sm_89"));
        assert!(a.ends_with("-sm_90.cubin"));
        assert_eq!(arch_name(9, 0), "sm_90");
    }

    #[test]
    fn the_cache_round_trips_and_ignores_other_keys() {
        let dir = std::env::temp_dir().join(format!("ferrolm-kcache-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(read_cached(&dir, "src", "sm_90"), None);
        write_cached(&dir, "src", "sm_90", b"\x7fELF");
        assert_eq!(
            read_cached(&dir, "src", "sm_90").as_deref(),
            Some(&b"\x7fELF"[..])
        );
        assert_eq!(read_cached(&dir, "src2", "sm_90"), None);
        assert_eq!(read_cached(&dir, "src", "sm_80"), None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn defines_go_before_the_source() {
        assert_eq!(source_with_defines(None), *SOURCE);
        let s = source_with_defines(Some("A=2, B ,".into()));
        assert!(s.starts_with("#define A 2\n#define B \n"));
        assert!(s.ends_with(SOURCE.as_str()));
    }

    #[test]
    fn the_source_has_no_includes() {
        assert!(!SOURCE.contains("#include"));
        assert!(SOURCE.contains("extern \"C\" __global__ void choose_token("));
    }

    /// NVRTC runs only where there is a GPU: here, at least, no function of the source is
    /// defined twice (a kernel name, or a plain device function outside a template), which it
    /// would refuse.
    #[test]
    fn no_function_is_defined_twice() {
        let mut seen = std::collections::HashSet::new();
        let lines: Vec<&str> = SOURCE.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let templated = i > 0 && lines[i - 1].trim_start().starts_with("template");
            let plain_device = line.starts_with("__device__") && !templated;
            if !(line.starts_with("extern \"C\" __global__") || plain_device) {
                continue;
            }
            // (a kernel's launch bounds go before its name, which may then start the next line)
            let mut text = line.to_string();
            if let Some(at) = text.find("__launch_bounds__(") {
                let close = text[at..].find(')').map_or(text.len(), |c| at + c + 1);
                text.replace_range(at..close, "");
                if !text.contains('(') {
                    text.push_str(lines.get(i + 1).copied().unwrap_or(""));
                }
            }
            let Some(open) = text.find('(') else { continue };
            let name = text[..open].split_whitespace().last().unwrap_or("");
            assert!(seen.insert(name.to_string()), "{name} is defined twice");
        }
        for kernel in [
            "rope_rows_slots",
            "attn_rows",
            "argmax_rows",
            "topk_rows",
            "skinny_gemm_16",
            "dq4k_gemm_16",
        ] {
            assert!(seen.contains(kernel), "{kernel}");
        }
    }
}
