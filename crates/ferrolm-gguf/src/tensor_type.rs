//! Tensor element types as GGUF numbers them (ggml's `ggml_type`), with their block geometry.
//!
//! The file format fixes the id, the number of elements per block and the bytes per block of
//! every type; the reader needs those to validate tensor sizes, so they live here rather than in
//! the crate that computes with the blocks.

use std::fmt;

macro_rules! tensor_types {
    ($( $variant:ident = $id:literal, $name:literal, $block:literal, $bytes:literal; )*) => {
        /// A tensor element type, numbered as in GGUF files.
        #[allow(non_camel_case_types)] // the names are the ones every GGUF tool prints
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[repr(u32)]
        pub enum TensorType {
            $(
                #[doc = concat!("`", $name, "`: ", stringify!($block), " elements in ", stringify!($bytes), " bytes.")]
                $variant = $id,
            )*
        }

        impl TensorType {
            /// Every known type, in id order.
            pub const ALL: &'static [TensorType] = &[$(TensorType::$variant),*];

            /// The type with GGUF id `id`, if it is one we know.
            pub fn from_id(id: u32) -> Option<TensorType> {
                match id {
                    $($id => Some(TensorType::$variant),)*
                    _ => None,
                }
            }

            /// The name llama.cpp prints for the type (`Q4_K`, `F16`, ...).
            pub fn name(self) -> &'static str {
                match self { $(TensorType::$variant => $name,)* }
            }

            /// Elements per block.
            pub fn block_size(self) -> usize {
                match self { $(TensorType::$variant => $block,)* }
            }

            /// Bytes per block.
            pub fn block_bytes(self) -> usize {
                match self { $(TensorType::$variant => $bytes,)* }
            }
        }
    };
}

tensor_types! {
    F32 = 0, "F32", 1, 4;
    F16 = 1, "F16", 1, 2;
    Q4_0 = 2, "Q4_0", 32, 18;
    Q4_1 = 3, "Q4_1", 32, 20;
    Q5_0 = 6, "Q5_0", 32, 22;
    Q5_1 = 7, "Q5_1", 32, 24;
    Q8_0 = 8, "Q8_0", 32, 34;
    Q8_1 = 9, "Q8_1", 32, 36;
    Q2_K = 10, "Q2_K", 256, 84;
    Q3_K = 11, "Q3_K", 256, 110;
    Q4_K = 12, "Q4_K", 256, 144;
    Q5_K = 13, "Q5_K", 256, 176;
    Q6_K = 14, "Q6_K", 256, 210;
    Q8_K = 15, "Q8_K", 256, 292;
    IQ2_XXS = 16, "IQ2_XXS", 256, 66;
    IQ2_XS = 17, "IQ2_XS", 256, 74;
    IQ3_XXS = 18, "IQ3_XXS", 256, 98;
    IQ1_S = 19, "IQ1_S", 256, 50;
    IQ4_NL = 20, "IQ4_NL", 32, 18;
    IQ3_S = 21, "IQ3_S", 256, 110;
    IQ2_S = 22, "IQ2_S", 256, 82;
    IQ4_XS = 23, "IQ4_XS", 256, 136;
    I8 = 24, "I8", 1, 1;
    I16 = 25, "I16", 1, 2;
    I32 = 26, "I32", 1, 4;
    I64 = 27, "I64", 1, 8;
    F64 = 28, "F64", 1, 8;
    IQ1_M = 29, "IQ1_M", 256, 56;
    BF16 = 30, "BF16", 1, 2;
    TQ1_0 = 34, "TQ1_0", 256, 54;
    TQ2_0 = 35, "TQ2_0", 256, 66;
    MXFP4 = 39, "MXFP4", 32, 17;
    NVFP4 = 40, "NVFP4", 64, 36;
    Q1_0 = 41, "Q1_0", 128, 18;
    Q2_0 = 42, "Q2_0", 64, 18;
}

impl TensorType {
    /// Bytes taken by `n_elements` elements, or `None` when `n_elements` is not a whole number
    /// of blocks or the byte count overflows.
    pub fn bytes_for(self, n_elements: u64) -> Option<u64> {
        let block = self.block_size() as u64;
        if !n_elements.is_multiple_of(block) {
            return None;
        }
        (n_elements / block).checked_mul(self.block_bytes() as u64)
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_unknown_ids_are_none() {
        for &t in TensorType::ALL {
            assert_eq!(TensorType::from_id(t as u32), Some(t));
        }
        assert_eq!(TensorType::from_id(4), None);
        assert_eq!(TensorType::from_id(43), None);
        assert_eq!(TensorType::from_id(41), Some(TensorType::Q1_0));
    }

    #[test]
    fn byte_counts_need_whole_blocks() {
        assert_eq!(TensorType::Q4_K.bytes_for(512), Some(288));
        assert_eq!(TensorType::Q4_0.bytes_for(33), None);
        assert_eq!(TensorType::F32.bytes_for(u64::MAX), None);
    }
}
