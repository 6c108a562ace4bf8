//! Which block type each matrix of a file gets, as `llama-quantize` chooses it for a file type
//! (llama.cpp b11312, `src/llama-quant.cpp`): the output matrix (and a tied embedding) in
//! Q6_K, Q4_K_M's extra bits for `attn_v` and `ffn_down` in some layers, and the fallbacks for
//! rows whose width is not a whole number of blocks. Written from the rules, not copied;
//! `scripts/shape_mix_check.py` checks it against llama.cpp's own quantizer (same type for
//! every tensor of smollm2-135m q4_k_m/q4_0, qwen2.5-0.5b q4_k_m/q8_0, llama-3.2-1b
//! q4_k_m/q4_0/q4_1).

use ferrolm_gguf::TensorType;

use crate::error::{ModelError, Result};

/// A whole-file quantization, as `llama-quantize` names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileType {
    /// Every matrix F16 (a converted, unquantized file).
    F16,
    /// Q4_0, with llama-quantize's Q6_K output.
    Q4_0,
    /// Q4_1, with llama-quantize's Q6_K output.
    Q4_1,
    /// Q5_0, with llama-quantize's Q6_K output.
    Q5_0,
    /// Q5_1, with llama-quantize's Q6_K output.
    Q5_1,
    /// Q8_0 everywhere.
    Q8_0,
    /// Q4_K, with Q6_K for the output and for `attn_v`/`ffn_down` in some layers.
    Q4KM,
    /// Q6_K everywhere.
    Q6K,
}

impl FileType {
    /// Every file type, in the order `--help` lists them.
    pub const ALL: [FileType; 8] = [
        FileType::F16,
        FileType::Q4_0,
        FileType::Q4_1,
        FileType::Q5_0,
        FileType::Q5_1,
        FileType::Q8_0,
        FileType::Q4KM,
        FileType::Q6K,
    ];

    /// The lower-case name on the command line (`q4_k_m`).
    pub fn name(self) -> &'static str {
        match self {
            FileType::F16 => "f16",
            FileType::Q4_0 => "q4_0",
            FileType::Q4_1 => "q4_1",
            FileType::Q5_0 => "q5_0",
            FileType::Q5_1 => "q5_1",
            FileType::Q8_0 => "q8_0",
            FileType::Q4KM => "q4_k_m",
            FileType::Q6K => "q6_k",
        }
    }

    /// The file type named `name` (case-insensitive).
    pub fn parse(name: &str) -> Result<FileType> {
        FileType::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(name))
            .ok_or_else(|| {
                let known: Vec<_> = FileType::ALL.iter().map(|t| t.name()).collect();
                ModelError::Invalid(format!(
                    "unknown file type {name:?} (known: {})",
                    known.join(", ")
                ))
            })
    }

    /// `general.file_type` (llama.cpp's `llama_ftype`).
    pub fn gguf_id(self) -> u32 {
        match self {
            FileType::F16 => 1,
            FileType::Q4_0 => 2,
            FileType::Q4_1 => 3,
            FileType::Q8_0 => 7,
            FileType::Q5_0 => 8,
            FileType::Q5_1 => 9,
            FileType::Q4KM => 15,
            FileType::Q6K => 18,
        }
    }

    /// The block type of a matrix no rule singles out.
    pub fn base_type(self) -> TensorType {
        match self {
            FileType::F16 => TensorType::F16,
            FileType::Q4_0 => TensorType::Q4_0,
            FileType::Q4_1 => TensorType::Q4_1,
            FileType::Q5_0 => TensorType::Q5_0,
            FileType::Q5_1 => TensorType::Q5_1,
            FileType::Q8_0 => TensorType::Q8_0,
            FileType::Q4KM => TensorType::Q4_K,
            FileType::Q6K => TensorType::Q6_K,
        }
    }
}

/// What a matrix is, as far as the type rules care.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// `token_embd.weight`; `tied` when it is the output matrix too.
    TokenEmbd {
        /// No separate `output.weight`.
        tied: bool,
    },
    /// `output.weight`.
    Output,
    /// `blk.N.attn_v.weight`.
    AttnV,
    /// `blk.N.ffn_down.weight`.
    FfnDown,
    /// Any other matrix.
    Other,
}

/// Whether layer `i` of `n` is one Q4_K_M gives more bits: the first and last eighth, and
/// every third layer between them.
pub fn use_more_bits(i: usize, n: usize) -> bool {
    let (i, n) = (i as i64, n as i64);
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

/// The block type of a matrix with rows of `row_len` values: `role` in layer `layer` of
/// `n_layer` (layer is ignored for the embedding and output). `pure` keeps the base type
/// everywhere (`llama-quantize --pure`), save the fallbacks for widths.
pub fn matrix_type(
    ftype: FileType,
    role: Role,
    layer: usize,
    n_layer: usize,
    row_len: usize,
    pure: bool,
) -> TensorType {
    let base = ftype.base_type();
    if base == TensorType::F16 {
        return TensorType::F16;
    }
    let chosen = if pure {
        base
    } else {
        match role {
            Role::Output | Role::TokenEmbd { tied: true } => {
                if !row_len.is_multiple_of(base.block_size()) || base == TensorType::Q8_0 {
                    TensorType::Q8_0
                } else {
                    TensorType::Q6_K
                }
            }
            Role::AttnV | Role::FfnDown
                if ftype == FileType::Q4KM && use_more_bits(layer, n_layer) =>
            {
                TensorType::Q6_K
            }
            _ => base,
        }
    };
    fallback(chosen, row_len)
}

/// A type whose blocks fit rows of `row_len` values: 256-value K-quants fall back to a
/// 32-value type, and F16 takes what no block fits.
fn fallback(ty: TensorType, row_len: usize) -> TensorType {
    if row_len.is_multiple_of(ty.block_size()) {
        return ty;
    }
    let smaller = match ty {
        TensorType::Q4_K => TensorType::Q5_0,
        TensorType::Q5_K => TensorType::Q5_1,
        TensorType::Q6_K => TensorType::Q8_0,
        other => other,
    };
    if row_len.is_multiple_of(smaller.block_size()) {
        smaller
    } else {
        TensorType::F16
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn more_bits_layers_of_sixteen() {
        let picked: Vec<usize> = (0..16).filter(|&i| use_more_bits(i, 16)).collect();
        assert_eq!(picked, [0, 1, 4, 7, 10, 13, 14, 15]);
    }

    #[test]
    fn widths_that_are_not_whole_k_blocks_fall_back() {
        let t = |role, ft, w| matrix_type(ft, role, 5, 24, w, false);
        assert_eq!(t(Role::Other, FileType::Q4KM, 896), TensorType::Q5_0);
        assert_eq!(t(Role::FfnDown, FileType::Q4KM, 896), TensorType::Q8_0);
        assert_eq!(t(Role::Output, FileType::Q4KM, 896), TensorType::Q8_0);
        assert_eq!(t(Role::Output, FileType::Q4_0, 2048), TensorType::Q6_K);
        assert_eq!(t(Role::Output, FileType::Q4_0, 576), TensorType::Q8_0);
        assert_eq!(t(Role::Output, FileType::Q8_0, 2048), TensorType::Q8_0);
        assert_eq!(t(Role::Other, FileType::Q4_0, 40), TensorType::F16);
        assert_eq!(t(Role::Output, FileType::F16, 2048), TensorType::F16);
        let untied = Role::TokenEmbd { tied: false };
        assert_eq!(t(untied, FileType::Q4KM, 4096), TensorType::Q4_K);
        assert_eq!(
            matrix_type(FileType::Q4KM, Role::Output, 0, 1, 2048, true),
            TensorType::Q4_K
        );
    }
}
