//! f32 buffers kept from one layer to the next. A prompt's per-layer intermediates are
//! megabytes each; allocated afresh, each costs page faults (the allocator hands large freed
//! blocks back to the system) and a zero fill that the products then overwrite.

/// Free buffers, reused by [`Buffers::take`], the most recently given last.
#[derive(Default)]
pub(crate) struct Buffers {
    free: Vec<Vec<f32>>,
}

/// Free buffers kept at most (a layer gives back about ten); past that, the least recently
/// given goes, so that the buffers of a long prompt do not outlive it by more than a layer or
/// two of shorter steps.
const KEEP: usize = 16;

impl Buffers {
    /// A buffer of `len` values that are left over from earlier use: only for outputs that
    /// are written whole before they are read. A free buffer of exactly that length if there
    /// is one (a layer asks for the same lengths as the one before, so after the first layer
    /// every request is met without allocating or filling), else a new one.
    pub fn take(&mut self, len: usize) -> Vec<f32> {
        match self.free.iter().rposition(|v| v.len() == len) {
            Some(i) => self.free.remove(i),
            None => vec![0.0; len],
        }
    }

    /// Gives `v` back for a later [`Buffers::take`].
    pub fn give(&mut self, v: Vec<f32>) {
        self.free.push(v);
        if self.free.len() > KEEP {
            self.free.remove(0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_of_the_same_length_come_back_as_they_were() {
        let mut b = Buffers::default();
        let fresh = b.take(100);
        assert_eq!(fresh, vec![0.0; 100]);
        let mut used = b.take(10);
        used.fill(7.0);
        let used_at = used.as_ptr();
        b.give(fresh);
        b.give(used);
        // The same length: the same buffer, its old values left as they were.
        let again = b.take(10);
        assert_eq!(again.as_ptr(), used_at);
        assert!(again.iter().all(|&v| v == 7.0));
        // Another length: a new, zeroed buffer; the 100-long one stays free.
        assert_eq!(b.take(8), vec![0.0; 8]);
        assert_eq!(b.free.len(), 1);
        // Past KEEP, the least recently given goes.
        for len in 1..=KEEP {
            b.give(vec![0.0; len]);
        }
        assert_eq!(b.free.len(), KEEP);
        assert!(b.free.iter().all(|v| v.len() != 100));
    }
}
