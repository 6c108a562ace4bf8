//! NEON kernels (aarch64).

use crate::kernel::{DotFn, RowsFn};
use crate::TensorType;

pub(crate) fn kernel(_ty: TensorType) -> Option<(DotFn, Option<RowsFn>)> {
    None
}
