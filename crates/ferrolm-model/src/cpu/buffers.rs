//! f32 buffers kept from one layer to the next. A prompt's per-layer intermediates are
//! megabytes each; allocated afresh, each costs page faults (the allocator hands large freed
//! blocks back to the system) and a zero fill that the products then overwrite.

/// Free buffers, reused by [`Buffers::take`].
#[derive(Default)]
pub(crate) struct Buffers {
    free: Vec<Vec<f32>>,
}

/// Free buffers kept at most (a layer uses about ten).
const KEEP: usize = 16;

impl Buffers {
    /// A buffer of `len` values that are left over from earlier use: only for outputs that
    /// are written whole before they are read. Takes the shortest free buffer that is long
    /// enough (so that buffers keep their lengths and need no fill), else the longest.
    pub fn take(&mut self, len: usize) -> Vec<f32> {
        let fits = (0..self.free.len())
            .filter(|&i| self.free[i].len() >= len)
            .min_by_key(|&i| self.free[i].len());
        let longest = (0..self.free.len()).max_by_key(|&i| self.free[i].len());
        let mut v = match fits.or(longest) {
            Some(i) => self.free.swap_remove(i),
            None => Vec::new(),
        };
        if v.len() > len {
            v.truncate(len);
        } else {
            v.resize(len, 0.0);
        }
        v
    }

    /// Gives `v` back for a later [`Buffers::take`].
    pub fn give(&mut self, v: Vec<f32>) {
        if self.free.len() < KEEP {
            self.free.push(v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_come_back_with_the_length_asked_for() {
        let mut b = Buffers::default();
        let big = b.take(100);
        assert_eq!(big, vec![0.0; 100]);
        let mut small = b.take(10);
        small.fill(7.0);
        let small_ptr = small.as_ptr();
        b.give(big);
        b.give(small);
        // The shortest that fits: the 10-long one, its old values left as they were.
        let again = b.take(8);
        assert_eq!((again.len(), again.as_ptr()), (8, small_ptr));
        assert!(again.iter().all(|&v| v == 7.0));
        // Nothing long enough: the longest, grown.
        let grown = b.take(150);
        assert_eq!(grown.len(), 150);
        assert!(b.take(0).is_empty());
    }
}
