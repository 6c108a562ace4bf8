//! The CPU executor of a layer plan.

pub(crate) mod attention;
pub(crate) mod buffers;
pub(crate) mod delta_net;
pub(crate) mod forward;
pub(crate) mod matmul;
pub(crate) mod ops;
pub(crate) mod routing;
