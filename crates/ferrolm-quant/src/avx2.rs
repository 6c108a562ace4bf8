//! AVX2 + FMA + F16C kernels (x86-64), picked at run time when the CPU has them.

use crate::kernel::{DotFn, RowsFn};
use crate::TensorType;

pub(crate) fn kernel(_ty: TensorType) -> Option<(DotFn, Option<RowsFn>)> {
    None
}
