//! Quantized matrix products: activations quantized once per input (shared by every matrix
//! that reads it), weight rows split across threads.

use ferrolm_gguf::TensorType;
use ferrolm_quant::DotKernel;
use ferrolm_threads::ThreadPool;

use crate::weights::Matrix;

/// Rows of activations quantized to one type, one row per token.
#[derive(Default)]
pub struct QuantizedRows {
    ty: Option<TensorType>,
    cols: usize,
    n: usize,
    stride: usize,
    data: Vec<u8>,
}

impl QuantizedRows {
    /// Quantizes `n` rows of `cols` values from `x` to `ty`, as llama.cpp's CPU backend does.
    pub fn quantize(
        &mut self,
        pool: &ThreadPool,
        x: &[f32],
        n: usize,
        cols: usize,
        ty: TensorType,
    ) {
        let stride =
            ferrolm_quant::row_bytes(ty, cols).expect("activation types take any whole row");
        self.data.resize(stride * n, 0);
        let quantize_row = |i: usize, dst: &mut [u8]| {
            ferrolm_quant::quantize_activation(ty, &x[i * cols..(i + 1) * cols], dst)
                .expect("sizes match");
        };
        if n == 1 {
            quantize_row(0, &mut self.data);
        } else {
            pool.for_each_chunk_mut(&mut self.data, stride, quantize_row);
        }
        *self = QuantizedRows {
            ty: Some(ty),
            cols,
            n,
            stride,
            data: std::mem::take(&mut self.data),
        };
    }

    /// Whether these rows hold `cols`-wide rows of `ty` for `n` tokens.
    pub fn holds(&self, ty: TensorType, n: usize, cols: usize) -> bool {
        self.ty == Some(ty) && self.n == n && self.cols == cols
    }
}

/// A small set of quantized copies of one input, one per activation type.
#[derive(Default)]
pub struct SharedInput {
    copies: Vec<QuantizedRows>,
    used: usize,
}

impl SharedInput {
    /// Forgets the previous input.
    pub fn reset(&mut self) {
        self.used = 0;
    }

    /// The input quantized for matrices of `weight_ty`, quantizing it on first use.
    pub fn get(
        &mut self,
        pool: &ThreadPool,
        x: &[f32],
        n: usize,
        cols: usize,
        weight_ty: TensorType,
    ) -> &QuantizedRows {
        let ty = ferrolm_quant::vec_dot_type(weight_ty).expect("bound matrices have a dot kernel");
        if let Some(i) = self.copies[..self.used]
            .iter()
            .position(|c| c.holds(ty, n, cols))
        {
            return &self.copies[i];
        }
        if self.used == self.copies.len() {
            self.copies.push(QuantizedRows::default());
        }
        self.copies[self.used].quantize(pool, x, n, cols, ty);
        self.used += 1;
        &self.copies[self.used - 1]
    }
}

impl SharedInput {
    /// Quantizes the input once for each of `weight_types` that needs its own copy.
    pub fn prepare(
        &mut self,
        pool: &ThreadPool,
        x: &[f32],
        n: usize,
        cols: usize,
        weight_types: &[TensorType],
    ) {
        for &ty in weight_types {
            self.get(pool, x, n, cols, ty);
        }
    }

    /// The copy for matrices of `weight_ty`, made by [`SharedInput::prepare`].
    pub fn rows_for(&self, weight_ty: TensorType) -> &QuantizedRows {
        let ty = ferrolm_quant::vec_dot_type(weight_ty).expect("bound matrices have a dot kernel");
        self.copies[..self.used]
            .iter()
            .find(|c| c.ty == Some(ty))
            .expect("prepared")
    }
}

/// Several products that read the same input (Q, K and V; gate and up), in one parallel step
/// when decoding one token, so that the threads meet once instead of once per matrix.
pub fn matmul_group(
    pool: &ThreadPool,
    file: &[u8],
    jobs: Vec<(&Matrix, &QuantizedRows, &mut [f32])>,
) {
    if jobs.iter().any(|(_, input, _)| input.n != 1) {
        for (w, input, out) in jobs {
            matmul(pool, w, file, input, out);
        }
        return;
    }
    let mut tasks = Vec::new();
    let mut kernels = Vec::with_capacity(jobs.len());
    let mut mats = Vec::with_capacity(jobs.len());
    for (j, (w, input, out)) in jobs.into_iter().enumerate() {
        assert_eq!(out.len(), w.rows);
        kernels.push(w.kernel);
        mats.push((w, &input.data[..input.stride]));
        for (c, chunk) in out.chunks_mut(ROWS_PER_TASK).enumerate() {
            tasks.push(std::sync::Mutex::new((j, c * ROWS_PER_TASK, chunk)));
        }
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    pool.run(&|_, _| loop {
        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let Some(task) = tasks.get(i) else { break };
        let mut task = task.lock().unwrap_or_else(|e| e.into_inner());
        let (j, r0, ref mut chunk) = *task;
        let (w, act) = mats[j];
        let rows = &w.data(file)[r0 * w.row_bytes..(r0 + chunk.len()) * w.row_bytes];
        kernels[j].dot_rows(w.cols, rows, w.row_bytes, act, chunk);
    });
}

/// Rows per task: enough work to amortize a task, small enough to balance threads; a multiple
/// of 4, which llama.cpp's tinyBLAS path (F16/F32 batches) needs to be taken.
const ROWS_PER_TASK: usize = 32;

/// `out[t * w.rows + r] = dot(row r of w, input row t)` for every token `t`.
pub fn matmul(pool: &ThreadPool, w: &Matrix, file: &[u8], input: &QuantizedRows, out: &mut [f32]) {
    let kernel: DotKernel = w.kernel;
    let data = w.data(file);
    let n_tok = input.n;
    assert_eq!(out.len(), n_tok * w.rows);
    if n_tok == 1 {
        let act = &input.data[..input.stride];
        pool.for_each_chunk_mut(out, ROWS_PER_TASK, |c, chunk| {
            let r0 = c * ROWS_PER_TASK;
            let rows = &data[r0 * w.row_bytes..(r0 + chunk.len()) * w.row_bytes];
            kernel.dot_rows(w.cols, rows, w.row_bytes, act, chunk);
        });
        return;
    }
    if kernel.splits_by_column() {
        // Every output of these kernels is its own row-by-column dot, whatever the tile, so the
        // batch can be split by tokens (parts of a multiple of 4): each task writes whole
        // output rows in place (no tile copies) and its activations stay in cache while the
        // weight rows stream past.
        let per_task = n_tok
            .div_ceil(4 * pool.n_threads().max(1))
            .next_multiple_of(8)
            .clamp(8, 64);
        pool.for_each_chunk_mut(out, per_task * w.rows, |c, chunk| {
            let t0 = c * per_task;
            let n = chunk.len() / w.rows;
            kernel.dot_rows_multi(
                w.cols,
                data,
                w.row_bytes,
                w.rows,
                &input.data[t0 * input.stride..],
                input.stride,
                n,
                chunk,
            );
        });
        return;
    }
    let n_tasks = w.rows.div_ceil(ROWS_PER_TASK);
    let tiles: Vec<Vec<f32>> = pool.map(n_tasks, |c| {
        let r0 = c * ROWS_PER_TASK;
        let n_rows = ROWS_PER_TASK.min(w.rows - r0);
        let rows = &data[r0 * w.row_bytes..(r0 + n_rows) * w.row_bytes];
        let mut tile = vec![0.0; n_rows * n_tok];
        kernel.dot_rows_multi(
            w.cols,
            rows,
            w.row_bytes,
            n_rows,
            &input.data,
            input.stride,
            n_tok,
            &mut tile,
        );
        tile
    });
    for (c, tile) in tiles.iter().enumerate() {
        let r0 = c * ROWS_PER_TASK;
        let n_rows = tile.len() / n_tok;
        for t in 0..n_tok {
            out[t * w.rows + r0..t * w.rows + r0 + n_rows]
                .copy_from_slice(&tile[t * n_rows..(t + 1) * n_rows]);
        }
    }
}
