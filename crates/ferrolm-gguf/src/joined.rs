//! The shards of a split model mapped side by side into one range of addresses.
//!
//! The model's code reads tensors as slices of one byte range; mapping each shard at its base
//! within one reservation keeps that true for split models, without copying a byte. The
//! reservation is an anonymous read-only mapping (its gaps read as zeros), and each shard's
//! file is mapped over its part with `MAP_FIXED`, which replaces pages of our own reservation
//! only. Like the single-file mapping, the bytes are read-only and untrusted.
#![allow(unsafe_code)] // the crate denies unsafe; this module is the second reasoned exception

use std::fs::File;
use std::io;

/// One reservation holding every shard at its base; unmapped as a whole when dropped.
pub(crate) struct JoinedMap {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is read-only for its whole life and owned by this value alone, so sharing
// or sending it between threads is as safe as sharing a `&[u8]`.
unsafe impl Send for JoinedMap {}
// SAFETY: as above.
unsafe impl Sync for JoinedMap {}

impl JoinedMap {
    /// Maps `total` bytes with each `(file, base, len)` at `base`; the caller guarantees that
    /// the parts lie within `total`, do not overlap, and start on page boundaries.
    #[cfg(unix)]
    pub(crate) fn map(total: u64, parts: &[(&File, u64, u64)]) -> io::Result<JoinedMap> {
        use std::os::unix::io::AsRawFd;
        let too_big = || io::Error::new(io::ErrorKind::InvalidInput, "shards too large to map");
        let len = usize::try_from(total).map_err(|_| too_big())?;
        for &(_, base, part) in parts {
            if base.checked_add(part).is_none_or(|end| end > total) {
                return Err(too_big());
            }
        }
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "nothing to map",
            ));
        }
        // SAFETY: a fresh anonymous mapping at an address of the kernel's choosing.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANON,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        // From here on, dropping `map` releases the reservation on every error path.
        let map = JoinedMap {
            ptr: ptr.cast(),
            len,
        };
        for &(file, base, part) in parts {
            if part == 0 {
                continue;
            }
            // SAFETY: `base + part <= total` (checked above), so the target lies inside our own
            // reservation, and MAP_FIXED replaces only those pages of it.
            let got = unsafe {
                libc::mmap(
                    map.ptr.add(base as usize).cast(),
                    part as usize,
                    libc::PROT_READ,
                    libc::MAP_SHARED | libc::MAP_FIXED,
                    file.as_raw_fd(),
                    0,
                )
            };
            if got == libc::MAP_FAILED {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(map)
    }

    /// Split models are mapped on Unix only.
    #[cfg(not(unix))]
    pub(crate) fn map(_total: u64, _parts: &[(&File, u64, u64)]) -> io::Result<JoinedMap> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "split GGUF models can be opened on Unix systems only",
        ))
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` readable bytes at `ptr` for as long as `self` lives (every page is
        // mapped: the reservation's own or a shard's; past a file's end within its last page
        // the kernel reads zeros).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for JoinedMap {
    fn drop(&mut self) {
        #[cfg(unix)]
        // SAFETY: unmaps exactly the range mapped in `map`, once; shard mappings inside it go too.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}
