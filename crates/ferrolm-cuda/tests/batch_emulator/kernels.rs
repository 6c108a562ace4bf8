//! The batched passes' kernels as host code: each reads its arguments by position as the
//! kernel's parameter list has them and does the work of the blocks its grid launches (a row
//! or token past the grid is left alone, as on the device). Products of quantized rows (the
//! per-pair expert products, the prompt's last-token output) use the CPU's own quantization
//! and dot kernels; the GEMMs multiply f16 operands as cuBLAS does, in f32.

use ferrolm_cuda::batch_device::{Gemm, Value};
use ferrolm_cuda::schedule::MATVEC_ROWS;

use super::{HostDevice, Memory};
use crate::host_math::{self as math, Rope, Routing};

/// A launch's arguments, read by position.
struct Args<'a>(&'a [Value]);

impl Args<'_> {
    fn ptr(&self, i: usize) -> u64 {
        match self.0[i] {
            Value::Ptr(p) if p != 0 => p,
            ref other => panic!("argument {i}: an address, found {other:?}"),
        }
    }

    /// An address that may be 0 (none).
    fn opt(&self, i: usize) -> Option<u64> {
        match self.0[i] {
            Value::Ptr(0) => None,
            Value::Ptr(p) => Some(p),
            ref other => panic!("argument {i}: an address, found {other:?}"),
        }
    }

    fn int(&self, i: usize) -> usize {
        match self.0[i] {
            Value::I32(v) => usize::try_from(v).expect("a size"),
            ref other => panic!("argument {i}: an int, found {other:?}"),
        }
    }

    fn long(&self, i: usize) -> usize {
        match self.0[i] {
            Value::I64(v) => usize::try_from(v).expect("a size"),
            ref other => panic!("argument {i}: a long, found {other:?}"),
        }
    }

    fn float(&self, i: usize) -> f32 {
        match self.0[i] {
            Value::F32(v) => v,
            ref other => panic!("argument {i}: a float, found {other:?}"),
        }
    }
}

/// The elements an element-wise launch covers of `n`: one thread each.
fn covered(grid: (u32, u32), block: u32, n: usize) -> usize {
    n.min(grid.0 as usize * block as usize)
}

/// Whether `name` is a gated activation's kernel family (`act(gate) * up`).
fn is_gated(name: &str) -> bool {
    name == "swiglu" || name == "geglu" || name == "swiglu_oai"
}

/// Runs kernel `name` on `dev`'s memory.
pub fn run(dev: &HostDevice, name: &str, grid: (u32, u32), block: u32, args: &[Value]) {
    let a = Args(args);
    let mem = &mut *dev.memory.borrow_mut();
    let rows = grid.0 as usize;
    if let Some(kernel) = name.strip_prefix("dequant_f16_") {
        dequantize(dev, mem, kernel, grid, block, &a);
    } else if let Some(kernel) = name.strip_prefix("embed_rows_") {
        // embed_rows(table, row_bytes, n_chunks, ids, x): block (chunk group, token)
        let (chunks, n) = (a.int(2), grid.1 as usize);
        assert!(
            grid.0 as usize * block as usize >= chunks,
            "{name}: chunks left out"
        );
        let (m, first) = dev.matrix(a.ptr(0));
        let spec = &dev.plan.matrices[m];
        assert_eq!((kernel, a.int(1)), (spec.kernel, spec.row_bytes()));
        let ids = mem.u32s(a.ptr(3), n);
        for (t, &id) in ids.iter().enumerate() {
            let row = dequantized_rows(dev, mem, a.ptr(0), first + id as usize, 1);
            mem.write(a.ptr(4) + (4 * t * 32 * chunks) as u64, &row);
        }
    } else if name == "scale_f32" {
        let n = covered(grid, block, a.long(1));
        let x: Vec<f32> = mem
            .f32s(a.ptr(0), n)
            .iter()
            .map(|v| v * a.float(2))
            .collect();
        mem.write(a.ptr(0), &x);
    } else if name == "rms_norm_rows" || name == "rms_norm_rows_f32" || name == "rms_norm" {
        // (x, w, out, n, eps): a block per row; rms_norm_rows writes f16
        let n = a.int(3);
        let w = mem.f32s(a.ptr(1), n);
        for r in 0..rows {
            let x = mem.f32s(a.ptr(0) + (4 * r * n) as u64, n);
            let y = math::rms_norm(&x, Some(&w), a.float(4));
            if name == "rms_norm_rows" {
                mem.write_f16s(a.ptr(2) + (2 * r * n) as u64, &y);
            } else {
                mem.write(a.ptr(2) + (4 * r * n) as u64, &y);
            }
        }
    } else if name == "moe_pad_rows" {
        // moe_pad_rows(ids, offsets, at, n_pairs, most): at[i] = ids[i] * most + rank
        let (pairs, most) = (covered(grid, block, a.int(3)), a.int(4) as u32);
        let ids = mem.u32s(a.ptr(0), pairs);
        let offsets = mem.u32s(a.ptr(1), ids.iter().max().map_or(0, |&e| e as usize + 1));
        let at: Vec<u32> = mem
            .u32s(a.ptr(2), pairs)
            .iter()
            .zip(&ids)
            .map(|(&r, &e)| e * most + (r - offsets[e as usize]))
            .collect();
        mem.write(a.ptr(2), &at);
    } else if name == "add_bias_rows" {
        // add_bias_rows(x, bias, d, n): x[i] += bias[i % d]
        let (d, n) = (a.int(2), covered(grid, block, a.long(3)));
        let bias = mem.f32s(a.ptr(1), d);
        let x: Vec<f32> = mem
            .f32s(a.ptr(0), n)
            .iter()
            .enumerate()
            .map(|(i, x)| x + bias[i % d])
            .collect();
        mem.write(a.ptr(0), &x);
    } else if name == "moe_add_bias" {
        // moe_add_bias(y, bias, ids, rows): grid (row blocks, pairs), pair j its expert's rows
        let rows_out = a.int(3);
        let pairs = grid.1 as usize;
        let ids = mem.u32s(a.ptr(2), pairs);
        for (j, &e) in ids.iter().enumerate() {
            let at = a.ptr(0) + (4 * j * rows_out) as u64;
            let bias = mem.f32s(a.ptr(1) + (4 * e as usize * rows_out) as u64, rows_out);
            let y: Vec<f32> = mem
                .f32s(at, rows_out)
                .iter()
                .zip(&bias)
                .map(|(y, b)| y + b)
                .collect();
            mem.write(at, &y);
        }
    } else if name == "quantize_rows_f16" || name == "quantize_rows_f32" {
        // quantize_rows_f16/_f32(x, xq, n, mode): block (group of 8 x 256 values, row)
        let n = a.int(2);
        assert!(grid.0 as usize * 8 * 256 >= n, "{name}: values left out");
        for t in 0..grid.1 as usize {
            let row = if name.ends_with("f16") {
                mem.f16s(a.ptr(0) + (2 * t * n) as u64, n)
            } else {
                mem.f32s(a.ptr(0) + (4 * t * n) as u64, n)
            };
            let at = a.ptr(1) + (t * (n + 8 * (n / 32))) as u64;
            mem.quantize(at, n + 8 * (n / 32), row, a.int(3) as i32);
        }
    } else if name == "rms_norm_rows_q" {
        // rms_norm_rows_q(x, w, out, xq, n, eps, mode): a block per row, f16 rows and
        // quantized ones
        let (n, eps, mode) = (a.int(4), a.float(5), a.int(6) as i32);
        let w = mem.f32s(a.ptr(1), n);
        for r in 0..rows {
            let x = mem.f32s(a.ptr(0) + (4 * r * n) as u64, n);
            let y = math::rms_norm(&x, Some(&w), eps);
            mem.write_f16s(a.ptr(2) + (2 * r * n) as u64, &y);
            let at = a.ptr(3) + (r * (n + 8 * (n / 32))) as u64;
            mem.quantize(at, n + 8 * (n / 32), y, mode);
        }
    } else if name == "glu_rows_q" {
        // glu_rows_q(g, u, out, xq, n, act, mode): grid (groups of 2048, rows)
        let (n, mode) = (a.int(4), a.int(6) as i32);
        assert!(grid.0 as usize * 2048 >= n, "{name}: values left out");
        let kernel = ["swiglu", "geglu", "swiglu_oai"][a.int(5)];
        for r in 0..grid.1 as usize {
            let g = mem.f32s(a.ptr(0) + (4 * r * n) as u64, n);
            let u = mem.f32s(a.ptr(1) + (4 * r * n) as u64, n);
            let y = math::gated(kernel, &g, &u);
            mem.write_f16s(a.ptr(2) + (2 * r * n) as u64, &y);
            let at = a.ptr(3) + (r * (n + 8 * (n / 32))) as u64;
            mem.quantize(at, n + 8 * (n / 32), y, mode);
        }
    } else if let Some(most) = name.strip_prefix("dq4k_gemm_") {
        assert_eq!(block, 256, "eight warps");
        assert!(
            grid.0 as usize * ferrolm_cuda::prefill::DQ_ROWS >= a.int(2),
            "rows left out"
        );
        // (the prefetch flag: computes nothing)
        assert!(matches!(a.int(9), 0 | 1), "prefetch {}", a.int(9));
        dq4k_gemm(dev, mem, most, [0, 1, 2, 3, 4, 5, 6, 7, 8], &a);
    } else if let Some(rest) = name.strip_prefix("dq4k_gemm3_") {
        // dq4k_gemm3_{most}: three (W, rows, C) segments, then row_bytes, n_sb, a, cols, n,
        // beta, prefetch; a block's rows in the segment its index falls in
        let most = rest;
        assert_eq!(block, 256, "eight warps");
        let blocks: usize = (0..3)
            .map(|s| a.int(3 * s + 1).div_ceil(ferrolm_cuda::prefill::DQ_ROWS))
            .sum();
        assert_eq!(
            grid.0 as usize, blocks,
            "{name}: a block a segment's 32 rows"
        );
        assert!(matches!(a.int(15), 0 | 1), "prefetch {}", a.int(15));
        assert!(
            a.int(1) > 0 && a.int(4) > 0,
            "{name}: two segments at least"
        );
        for s in (0..3).filter(|&s| a.int(3 * s + 1) > 0) {
            dq4k_gemm(
                dev,
                mem,
                most,
                [3 * s, 9, 3 * s + 1, 10, 11, 12, 13, 3 * s + 2, 14],
                &a,
            );
        }
    } else if let Some(most) = name.strip_prefix("dq4k_glu_") {
        assert_eq!(block, 256, "eight warps");
        dq4k_glu(dev, mem, most, grid, &a);
    } else if let Some(most) = name.strip_prefix("dq6k_pipe_") {
        // dq6k_pipe_{most}: dq4k_pipe's arguments, Q6_KR rows, DQ6_PIPE's layout
        pipe_grid(name, grid, block, ferrolm_cuda::prefill::DQ6_PIPE.0, &a);
        dq4k_gemm(dev, mem, most, [0, 1, 2, 3, 5, 6, 7, 8, 9], &a);
    } else if let Some(layout) = name.strip_prefix("dq4k_pipe_") {
        let (most, pipe) = layout.split_once('_').expect("dq4k_pipe_{most}_{layout}");
        let (warps, stages) = pipe.split_once('x').expect("{warps}x{stages}");
        let warps: usize = warps.parse().expect("warps");
        assert!(ferrolm_cuda::prefill::DQ_PIPES.contains(&(warps, stages.parse().expect("stages"))));
        pipe_grid(name, grid, block, warps, &a);
        dq4k_gemm(dev, mem, most, [0, 1, 2, 3, 5, 6, 7, 8, 9], &a);
    } else if let Some(kernel) = name.strip_prefix("mmq_") {
        mmq(dev, mem, kernel, grid, block, &a);
    } else if name == "delta_conv_rows_runs" {
        // (the runs of tokens: the same outputs and state)
        delta_conv_rows(mem, &a);
    } else if name == "delta_rule_rows" {
        delta_rule_rows(mem, grid, block, &a);
    } else if name == "delta_qk_norm_rows" {
        delta_qk_norm_rows(mem, grid, block, &a);
    } else if name == "delta_chunk_gram" {
        delta_chunk_gram(mem, grid, &a);
    } else if name == "delta_rule_chunks" {
        delta_rule_chunks(mem, grid, block, &a);
    } else if name == "delta_gated_norm_rows" {
        delta_gated_norm_rows(mem, grid, block, &a);
    } else if name == "delta_conv_slots" {
        delta_conv_slots(mem, grid, &a);
    } else if name == "delta_rule_slots" {
        delta_rule_slots(mem, grid, block, &a);
    } else if name == "split_query_gate_rows" {
        // split_query_gate_rows(qg, q, g, n_head, hd): grid (width / 256, tokens)
        let (w, hd) = (a.int(3) * a.int(4), a.int(4));
        assert!(covered(grid, block, w) == w, "{name}: values left out");
        for t in 0..grid.1 as usize {
            let row = mem.f32s(a.ptr(0) + (4 * t * 2 * w) as u64, 2 * w);
            let (mut q, mut g) = (Vec::new(), Vec::new());
            for head in row.chunks(2 * hd) {
                q.extend_from_slice(&head[..hd]);
                g.extend_from_slice(&head[hd..]);
            }
            mem.write(a.ptr(1) + (4 * t * w) as u64, &q);
            mem.write(a.ptr(2) + (4 * t * w) as u64, &g);
        }
    } else if name == "sigmoid_mul_f16" {
        // sigmoid_mul_f16(x, g, n): x (f16) *= sigmoid(g)
        let n = covered(grid, block, a.long(2));
        let g = mem.f32s(a.ptr(1), n);
        let x: Vec<f32> = mem
            .f16s(a.ptr(0), n)
            .iter()
            .zip(&g)
            .map(|(x, g)| x * (1.0 / (1.0 + (-g).exp())))
            .collect();
        mem.write_f16s(a.ptr(0), &x);
    } else if name == "rope_rows" {
        rope_rows(mem, grid, &a, false);
    } else if name == "rope_rows_slots" {
        rope_rows(mem, grid, &a, true);
    } else if let Some(hd) = name.strip_prefix("attn_mma_") {
        // attn_mma_HD(q, kc, vc, out, pos0, n, n_head, n_head_kv, scale, cap, window)
        let hd: usize = hd.parse().expect("a head width");
        let (_, queries) = ferrolm_cuda::prefill::mma_attention(hd).expect("a served width");
        assert_eq!(block as usize, 2 * queries, "{name}: a warp per 16 queries");
        prompt_attention(mem, grid, queries, hd, &a, [8, 9, 10]);
    } else if name == "attn_tile" {
        // attn_tile(q, kc, vc, out, pos0, n, n_head, n_head_kv, hd, scale, cap, window)
        prompt_attention(mem, grid, 16, a.int(8), &a, [9, 10, 11]);
    } else if name == "attn_rows" {
        rows_attention(mem, grid, &a);
    } else if name == "post_norm_add" {
        // post_norm_add(y, w, x, n, eps, scale): x[r] += (norm(y[r]) * w) * scale
        let (n, eps, scale) = (a.int(3), a.float(4), a.float(5));
        let w = a.opt(1).map(|w| mem.f32s(w, n));
        for r in 0..rows {
            let y = mem.f32s(a.ptr(0) + (4 * r * n) as u64, n);
            let o = match &w {
                Some(w) => math::rms_norm(&y, Some(w), eps),
                None => y,
            };
            let xr = a.ptr(2) + (4 * r * n) as u64;
            let x: Vec<f32> = mem
                .f32s(xr, n)
                .iter()
                .zip(&o)
                .map(|(x, o)| x + o * scale)
                .collect();
            mem.write(xr, &x);
        }
    } else if let Some(act) = name.strip_suffix("_pairs_f16").filter(|&a| is_gated(a)) {
        // (gu, act, ff, n): row t of gu holds its gate, then its up values
        let (ff, n) = (a.int(2), covered(grid, block, a.long(3)));
        let gu = mem.f32s(a.ptr(0), 2 * n.div_ceil(ff) * ff);
        let (g, u): (Vec<f32>, Vec<f32>) = (0..n)
            .map(|i| {
                (
                    gu[i / ff * 2 * ff + i % ff],
                    gu[i / ff * 2 * ff + ff + i % ff],
                )
            })
            .unzip();
        mem.write_f16s(a.ptr(1), &math::gated(act, &g, &u));
    } else if let Some(act) = name.strip_suffix("_f16").filter(|&a| is_gated(a)) {
        // (g, u, out, n), out f16
        let n = covered(grid, block, a.long(3));
        let (g, u) = (mem.f32s(a.ptr(0), n), mem.f32s(a.ptr(1), n));
        mem.write_f16s(a.ptr(2), &math::gated(act, &g, &u));
    } else if is_gated(name) {
        // (g, u, out, n), f32 (the per-pair expert path)
        let n = covered(grid, block, a.int(3));
        let (g, u) = (mem.f32s(a.ptr(0), n), mem.f32s(a.ptr(1), n));
        mem.write(a.ptr(2), &math::gated(name, &g, &u));
    } else if name == "moe_route" {
        route(dev, mem, rows, &a);
    } else if name == "moe_group" || name == "moe_group_warp" {
        // moe_group(ids, n_pairs, ne, counts, offsets, at)
        let (pairs, ne) = (a.int(1), a.int(2));
        let ids = mem.u32s(a.ptr(0), pairs);
        let mut counts = vec![0u32; ne];
        ids.iter().for_each(|&e| counts[e as usize] += 1);
        let offsets: Vec<u32> = counts
            .iter()
            .scan(0, |o, &c| {
                *o += c;
                Some(*o - c)
            })
            .collect();
        let mut next = offsets.clone();
        let at: Vec<u32> = ids
            .iter()
            .map(|&e| {
                next[e as usize] += 1;
                next[e as usize] - 1
            })
            .collect();
        mem.write(a.ptr(3), &counts);
        mem.write(a.ptr(4), &offsets);
        mem.write(a.ptr(5), &at);
    } else if name == "moe_gather_f16" {
        // moe_gather_f16(src, at, k, d, dst): row at[i] of dst = row i / k of src
        let (k, d) = (a.int(2), a.int(3));
        let at = mem.u32s(a.ptr(1), rows);
        for (i, &to) in at.iter().enumerate() {
            let row = mem.read::<u16>(a.ptr(0) + (2 * (i / k) * d) as u64, d);
            mem.write(a.ptr(4) + (2 * to as usize * d) as u64, &row);
        }
    } else if name.starts_with("moe_matvec") {
        expert_products(dev, mem, name, grid, &a);
    } else if name == "moe_combine" {
        combine(mem, grid, block, &a);
    } else if name == "adjust_logits" {
        // adjust_logits(x, n, inv_cap, cap, inv_scale)
        let n = covered(grid, block, a.long(1));
        let adjust = [a.float(2), a.float(3), a.float(4)];
        let v: Vec<f32> = mem
            .f32s(a.ptr(0), n)
            .iter()
            .map(|&v| math::adjust_logit(v, adjust))
            .collect();
        mem.write(a.ptr(0), &v);
    } else if name == "argmax_rows" {
        // argmax_rows(x, n, out): a block per row
        let n = a.int(1);
        for r in 0..rows {
            let best = math::argmax(&mem.f32s(a.ptr(0) + (4 * r * n) as u64, n));
            mem.write(a.ptr(2) + 4 * r as u64, &[best as u32]);
        }
    } else if name == "topk_rows" {
        // topk_rows(x, n, k, ids, vals): a block per row, its k largest (any order)
        let (n, k) = (a.int(1), a.int(2));
        for r in 0..rows {
            let x = mem.f32s(a.ptr(0) + (4 * r * n) as u64, n);
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_by(|&i, &j| x[j].total_cmp(&x[i]));
            let ids: Vec<u32> = order[..k].iter().map(|&i| i as u32).collect();
            let vals: Vec<f32> = order[..k].iter().map(|&i| x[i]).collect();
            mem.write(a.ptr(3) + (4 * r * k) as u64, &ids);
            mem.write(a.ptr(4) + (4 * r * k) as u64, &vals);
        }
    } else if name == "choose_token" {
        // choose_token(logits, n, token, pos, advance, cfg, draws, draw_idx, ring): greedy
        // (the test's sampling settings are zeros)
        assert_eq!(a.opt(3), None, "the batched passes keep no position");
        assert_eq!(a.opt(8), None, "the batched passes write no ring");
        let logits = mem.f32s(a.ptr(0), a.int(1));
        a.ptr(5); // (the settings are read on the device: present)
        mem.write(a.ptr(2), &[math::argmax(&logits) as u32]);
    } else if let Some(kernel) = name.strip_prefix("matvec_") {
        // matvec(W, row_bytes, n_chunks, n_rows, x, add0, add1, y): the prompt's last token
        let (cols, n_rows) = (32 * a.int(2), a.int(3));
        assert!(rows * MATVEC_ROWS >= n_rows, "{name}: rows left out");
        let (m, first) = dev.matrix(a.ptr(0));
        assert_eq!(kernel, dev.plan.matrices[m].kernel);
        let x = mem.f32s(a.ptr(4), cols);
        let mut y = products(dev, mem, a.ptr(0), first, n_rows, &x);
        for add in [5, 6] {
            if let Some(b) = a.opt(add) {
                y.iter_mut()
                    .zip(mem.f32s(b, n_rows))
                    .for_each(|(y, b)| *y += b);
            }
        }
        mem.write(a.ptr(7), &y);
    } else {
        panic!("no emulation of {name}");
    }
}

/// Rows `first..first + n` of the matrix at `addr` (read from the memory), dequantized.
fn dequantized_rows(dev: &HostDevice, mem: &Memory, addr: u64, first: usize, n: usize) -> Vec<f32> {
    let (m, start) = dev.matrix(addr);
    let spec = &dev.plan.matrices[m];
    let rb = spec.row_bytes();
    let base = addr - (start * rb) as u64;
    let bytes = mem.bytes(base + (first * rb) as u64, n * rb);
    let mut out = vec![0f32; n * spec.cols];
    ferrolm_quant::dequantize(spec.ty, bytes, &mut out).unwrap();
    out
}

/// dequant_f16_T(W, row_bytes, n_chunks, total, out): a thread per 32-value chunk.
fn dequantize(
    dev: &HostDevice,
    mem: &mut Memory,
    kernel: &str,
    grid: (u32, u32),
    block: u32,
    a: &Args,
) {
    let (m, first) = dev.matrix(a.ptr(0));
    let spec = &dev.plan.matrices[m];
    assert_eq!(kernel, spec.kernel, "dequantized as another type");
    let (rb, chunks, total) = (a.int(1), a.int(2), a.long(3));
    assert_eq!((rb, 32 * chunks), (spec.row_bytes(), spec.cols));
    let done = covered(grid, block, total);
    let values = dequantized_rows(dev, mem, a.ptr(0), first, total / chunks);
    mem.write_f16s(a.ptr(4), &values[..32 * done]);
}

/// The GEMM: `c[t][r] = a[t] . w[r] (+ beta * c[t][r])`, f16 (or f32) operands, f32 sums.
pub fn gemm(mem: &mut Memory, g: Gemm) {
    for i in 0..g.batch {
        let (rows, cols, n) = (g.rows, g.cols, g.n);
        one_gemm(
            mem,
            Gemm {
                w16: g.w16 + (2 * i * rows * cols) as u64,
                a: g.a + (2 * i * n * cols) as u64,
                c: g.c + (4 * i * n * rows) as u64,
                batch: 1,
                ..g
            },
        );
    }
}

fn one_gemm(mem: &mut Memory, g: Gemm) {
    let (rows, cols, n) = (g.rows, g.cols, g.n);
    let (w, x) = if g.f32_operands {
        (mem.f32s(g.w16, rows * cols), mem.f32s(g.a, n * cols))
    } else {
        (mem.f16s(g.w16, rows * cols), mem.f16s(g.a, n * cols))
    };
    let mut out = if g.beta == 0.0 {
        vec![0f32; n * rows]
    } else {
        mem.f32s(g.c, n * rows).iter().map(|v| v * g.beta).collect()
    };
    for t in 0..n {
        let xt = &x[t * cols..][..cols];
        for r in 0..rows {
            let wr = &w[r * cols..][..cols];
            out[t * rows + r] += xt.iter().zip(wr).map(|(x, w)| x * w).sum::<f32>();
        }
    }
    mem.write(g.c, &out);
}

/// Rows `first..first + n` of the matrix at `addr` dotted with `x`, as the CPU multiplies
/// them: `x` quantized to the row type's activation format, the row type's dot kernel.
fn products(
    dev: &HostDevice,
    mem: &Memory,
    addr: u64,
    first: usize,
    n: usize,
    x: &[f32],
) -> Vec<f32> {
    let (m, start) = dev.matrix(addr);
    let spec = &dev.plan.matrices[m];
    let rb = spec.row_bytes();
    let base = addr - (start * rb) as u64;
    let kernel = ferrolm_quant::dot_kernel(spec.ty).unwrap();
    let act_ty = kernel.activation_type();
    let mut act = vec![0u8; ferrolm_quant::row_bytes(act_ty, x.len()).unwrap()];
    ferrolm_quant::quantize_activation(act_ty, x, &mut act).unwrap();
    (first..first + n)
        .map(|r| kernel.dot(x.len(), mem.bytes(base + (r * rb) as u64, rb), &act))
        .collect()
}

/// mmq_T(W, row_bytes, n_chunks, n_rows, xq, n_cols, y, beta): block (16 columns, 16 rows);
/// column t of y (n_rows wide) = W . row t of xq (+ beta times what it held), as the CPU's dot
/// kernel multiplies them.
fn mmq(dev: &HostDevice, mem: &mut Memory, kernel: &str, grid: (u32, u32), block: u32, a: &Args) {
    use ferrolm_cuda::prefill::{MMQ_COLS, MMQ_ROWS};
    let (rb, cols, n_rows, n_cols) = (a.int(1), 32 * a.int(2), a.int(3), a.int(5));
    let (m, first) = dev.matrix(a.ptr(0));
    let spec = &dev.plan.matrices[m];
    assert_eq!(
        (kernel, rb, cols, first),
        (spec.kernel, spec.row_bytes(), spec.cols, 0)
    );
    assert!(grid.0 as usize * MMQ_COLS >= n_cols, "columns left out");
    assert!(grid.1 as usize * MMQ_ROWS >= n_rows, "rows left out");
    assert_eq!(block, 128, "four warps");
    let beta = a.float(7);
    for t in 0..n_cols {
        let x = mem.quantized(a.ptr(4) + (t * (cols + 8 * (cols / 32))) as u64, spec.ty);
        let mut y = products(dev, mem, a.ptr(0), 0, n_rows, &x);
        let out = a.ptr(6) + (4 * t * n_rows) as u64;
        if beta != 0.0 {
            let was = mem.f32s(out, n_rows);
            y.iter_mut().zip(was).for_each(|(y, w)| *y += beta * w);
        }
        mem.write(out, &y);
    }
}

/// The launch of a pipelined product (dq4k_pipe_{most}_{warps}x{stages}, dq6k_pipe_{most}:
/// W, row_bytes, n_rows, n_sb, run, a, cols, n, y, beta, partial, counters): row blocks of
/// 32 x `warps` rows, runs of `run` super-blocks that hold them all, as `dq_pipe_grid` says.
fn pipe_grid(name: &str, grid: (u32, u32), block: u32, warps: usize, a: &Args) {
    assert_eq!(block as usize, 32 * warps, "{name}: its warps");
    let (n_rows, n_sb, run) = (a.int(2), a.int(3), a.int(4));
    assert_eq!(
        (grid.0 as usize, grid.1 as usize, run),
        ferrolm_cuda::prefill::dq_pipe_grid(n_rows, n_sb, warps),
        "{name}: its grid"
    );
    assert!(grid.1 as usize * run >= n_sb && (grid.1 as usize - 1) * run < n_sb);
}

/// dq4k_gemm_8/_16(W, row_bytes, n_rows, n_sb, a, cols, n, y, beta, prefetch) and
/// dq4k_pipe_*'s same arguments (at `at`, in that order): `y[t][r] = a[t] . w[r] (+ beta y[t][r])` for the n (at
/// most 8 or 16) f16 rows of `a`, f32 sums, each weight as the kernels make it: `q * half(d
/// sc) - half(dmin m)` rounded once to f16.
fn dq4k_gemm(dev: &HostDevice, mem: &mut Memory, most: &str, at: [usize; 9], a: &Args) {
    let arg = |i: usize| at[i];
    let products = dq4k_products(
        dev,
        mem,
        most,
        [at[0], at[1], at[2], at[3], at[4], at[5], at[6]],
        a,
    );
    let n = a.int(arg(6));
    let n_rows = a.int(arg(2));
    let beta = a.float(arg(8));
    let out = a.ptr(arg(7));
    let mut y = if beta == 0.0 {
        vec![0f32; n * n_rows]
    } else {
        mem.f32s(out, n * n_rows).iter().map(|v| v * beta).collect()
    };
    for (y, p) in y.iter_mut().zip(products) {
        *y += p;
    }
    mem.write(out, &y);
}

/// dq4k_glu_8/_16(Wg, Wu, row_bytes, n_rows, n_sb, a, cols, n, act, gelu, prefetch): gate and
/// up products as dq4k_gemm's, then `act[t][r] = f16(act(g) * u)`.
fn dq4k_glu(dev: &HostDevice, mem: &mut Memory, most: &str, grid: (u32, u32), a: &Args) {
    assert_eq!(
        grid.0 as usize,
        a.int(3).div_ceil(16),
        "16 rows of each a block"
    );
    assert!(matches!(a.int(10), 0 | 1), "prefetch {}", a.int(10));
    let g = dq4k_products(dev, mem, most, [0, 2, 3, 4, 5, 6, 7], a);
    let u = dq4k_products(dev, mem, most, [1, 2, 3, 4, 5, 6, 7], a);
    let act = match a.int(9) {
        0 => "swiglu",
        1 => "geglu",
        other => panic!("activation {other}"),
    };
    mem.write_f16s(a.ptr(8), &math::gated(act, &g, &u));
}

/// The products `y[t][r] = a[t] . w[r]` of dq4k_gemm_*'s arguments (W, row_bytes, n_rows,
/// n_sb, a, cols, n at `at`): f32 sums of each weight as the kernels make it.
fn dq4k_products(dev: &HostDevice, mem: &Memory, most: &str, at: [usize; 7], a: &Args) -> Vec<f32> {
    use ferrolm_cuda::prefill::DQ_MAX_ROWS;
    let arg = |i: usize| at[i];
    let (rb, n_rows, n_sb, cols, n) = (
        a.int(arg(1)),
        a.int(arg(2)),
        a.int(arg(3)),
        a.int(arg(5)),
        a.int(arg(6)),
    );
    let (m, first) = dev.matrix(a.ptr(arg(0)));
    let spec = &dev.plan.matrices[m];
    assert_eq!(
        (rb, n_rows, 256 * n_sb, cols),
        (spec.row_bytes(), spec.rows, spec.cols, spec.cols)
    );
    assert_eq!(first, 0, "a whole matrix");
    let most: usize = most.parse().expect("dq4k_gemm_8 or _16");
    assert!(
        n <= most && most <= DQ_MAX_ROWS,
        "{n} rows in dq4k_gemm_{most}"
    );
    let rows = mem.bytes(a.ptr(arg(0)), n_rows * rb);
    let w: Vec<f32> = match spec.kernel {
        "Q4_K" => rows.chunks_exact(144).flat_map(q4_k_in_f16).collect(),
        // (the emulator holds the file's rows: regrouped here as the device holds them)
        "Q6_KR" => ferrolm_cuda::repack::repack(spec.ty, cols, rows)
            .expect("Q6_K regroups")
            .chunks_exact(rb)
            .flat_map(q6_kr_in_f16)
            .collect(),
        k => panic!("{k} rows read by a pipelined product"),
    };
    let x = mem.f16s(a.ptr(arg(4)), n * cols);
    let mut y = vec![0f32; n * n_rows];
    for t in 0..n {
        let xt = &x[t * cols..][..cols];
        for r in 0..n_rows {
            let wr = &w[r * cols..][..cols];
            y[t * n_rows + r] = xt.iter().zip(wr).map(|(x, w)| x * w).sum::<f32>();
        }
    }
    y
}

/// A regrouped Q6_K row's weights (Q6_KR: every ql, then every qh, scales and d) as
/// `dq6k_pipe_*` makes them: `(q - 32) * half(d sc)` rounded once to f16.
fn q6_kr_in_f16(row: &[u8]) -> Vec<f32> {
    use half::f16;
    let nb = row.len() / 210;
    let (ql, qh, sc, d) = (
        &row[..128 * nb],
        &row[128 * nb..192 * nb],
        &row[192 * nb..208 * nb],
        &row[208 * nb..],
    );
    let mut out = vec![0f32; 256 * nb];
    for b in 0..nb {
        let d = f16::from_le_bytes([d[2 * b], d[2 * b + 1]]).to_f32();
        for (i, w) in out[256 * b..][..256].iter_mut().enumerate() {
            // (value i: half n, quarter q, position l, as the CPU's dequantization reads them)
            let (n, q, l) = (i / 128, i % 128 / 32, i % 32);
            let lo = ql[128 * b + 64 * n + 32 * (q % 2) + l] >> (4 * (q / 2)) & 15;
            let hi = qh[64 * b + 32 * n + l] >> (2 * q) & 3;
            let s = sc[16 * b + 8 * n + 2 * q + l / 16] as i8;
            let scale = f16::from_f32(d * f32::from(s)).to_f64();
            *w = f16::from_f64(f64::from(i16::from(lo | hi << 4) - 32) * scale).to_f32();
        }
    }
    out
}

/// A Q4_K super-block's 256 weights as `dq4k_gemm_*` makes them in f16 arithmetic.
fn q4_k_in_f16(b: &[u8]) -> Vec<f32> {
    use half::f16;
    let h = |i: usize| f16::from_le_bytes([b[i], b[i + 1]]).to_f32();
    let (d, dmin, s, qs) = (h(0), h(2), &b[4..16], &b[16..]);
    let mut out = vec![0f32; 256];
    for j in 0..8 {
        let (sc, mn) = if j < 4 {
            (s[j] & 63, s[j + 4] & 63)
        } else {
            (
                (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4),
                (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
            )
        };
        let ds = f16::from_f32(d * f32::from(sc)).to_f64();
        let dm = f16::from_f32(dmin * f32::from(mn)).to_f64();
        for l in 0..32 {
            let q = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 15;
            out[32 * j + l] = f16::from_f64(f64::from(q) * ds - dm).to_f32();
        }
    }
    out
}

/// rope_rows (token t at position pos0 + t, its q, k, v rows packed) or, `by_slot`,
/// rope_rows_slots (token t at slot[t], pos[t], its rows q_stride and kv_stride apart): a
/// block per (head, token), queries rotated in place, keys rotated and values stored as f16
/// at the position in the cache.
fn rope_rows(mem: &mut Memory, grid: (u32, u32), a: &Args, by_slot: bool) {
    // The rotation's arguments follow the placement's: 1 (pos0) or 5 of them.
    let r = if by_slot { 15 } else { 11 };
    let (nh, nkv, hd, n_dims) = (a.int(r), a.int(r + 1), a.int(r + 2), a.int(r + 3));
    let neox = a.int(r + 4) == 1;
    let (theta_scale, freq_scale, eps) = (a.float(r + 5), a.float(r + 6), a.float(r + 8));
    let ff = a.opt(r + 7).map(|f| mem.f32s(f, n_dims / 2));
    let scaling = [0, 1, 2, 3].map(|i| a.float(r + 9 + i));
    let vec_of = |mem: &Memory, i: usize, n: usize| a.opt(i).map(|p| mem.f32s(p, n));
    let biases = [
        vec_of(mem, 3, nh * hd),
        vec_of(mem, 4, nkv * hd),
        vec_of(mem, 5, nkv * hd),
    ];
    let norms = [vec_of(mem, 6, hd), vec_of(mem, 7, hd)];
    for t in 0..grid.1 as usize {
        let (p, cache, q_row, kv_row) = if by_slot {
            let slot = mem.u32s(a.ptr(10) + 4 * t as u64, 1)[0] as usize;
            let p = mem.u32s(a.ptr(11) + 4 * t as u64, 1)[0] as usize;
            (p, slot * a.long(12), t * a.int(13), t * a.int(14))
        } else {
            (a.int(10) + t, 0, t * nh * hd, t * nkv * hd)
        };
        let rope = Rope {
            p,
            n_dims,
            neox,
            theta_scale,
            freq_scale,
            ff: ff.clone(),
            scaling,
        };
        for b in 0..grid.0 as usize {
            let is_q = b < nh;
            let h = if is_q { b } else { b - nh };
            let (src, bias, norm) = if is_q {
                (
                    a.ptr(0) + 4 * (q_row + h * hd) as u64,
                    &biases[0],
                    &norms[0],
                )
            } else {
                (
                    a.ptr(1) + 4 * (kv_row + h * hd) as u64,
                    &biases[1],
                    &norms[1],
                )
            };
            let mut head = mem.f32s(src, hd);
            if let Some(bias) = bias {
                head.iter_mut()
                    .zip(&bias[h * hd..])
                    .for_each(|(x, b)| *x += b);
            }
            if let Some(w) = norm {
                head = math::rms_norm(&head, Some(w), eps);
            }
            rope.rotate(&mut head);
            if is_q {
                mem.write(src, &head);
            } else {
                let at = 2 * (cache + p * nkv * hd + h * hd) as u64;
                mem.write_f16s(a.ptr(8) + at, &head);
                let mut v = mem.f32s(a.ptr(2) + 4 * (kv_row + h * hd) as u64, hd);
                if let Some(bias) = &biases[2] {
                    v.iter_mut().zip(&bias[h * hd..]).for_each(|(x, b)| *x += b);
                }
                mem.write_f16s(a.ptr(9) + at, &v);
            }
        }
    }
}

/// The prompt's causal attention, `tile` queries a block: query head h of token t (at
/// position pos0 + t) over the cache positions it sees; `scalars` index scale, cap, window.
fn prompt_attention(
    mem: &mut Memory,
    grid: (u32, u32),
    tile: usize,
    hd: usize,
    a: &Args,
    [scale, cap, window]: [usize; 3],
) {
    let (pos0, n, nh, nkv) = (a.int(4), a.int(5), a.int(6), a.int(7));
    // (the sinks follow the window)
    let sinks = a.opt(window + 1).map(|s| mem.f32s(s, nh));
    let (scale, cap, window) = (a.float(scale), a.float(cap), a.int(window));
    let len = pos0 + n;
    let row = nkv * hd;
    let (keys, values) = (mem.f16s(a.ptr(1), len * row), mem.f16s(a.ptr(2), len * row));
    let q = mem.f32s(a.ptr(0), n * nh * hd);
    for t in 0..n.min(grid.1 as usize * tile) {
        let p = pos0 + t;
        let lo = if window > 0 {
            (p + 1).saturating_sub(window)
        } else {
            0
        };
        for h in 0..grid.0 as usize {
            let qh = f16_round(&q[(t * nh + h) * hd..][..hd]);
            let kvh = h / (nh / nkv);
            let sink = sinks.as_ref().map(|s| s[h]);
            let scalars = (scale, cap, sink);
            let o = math::attend(&qh, &keys, &values, row, kvh * hd, (lo, p + 1), scalars);
            mem.write_f16s(a.ptr(3) + 2 * ((t * nh + h) * hd) as u64, &o);
        }
    }
}

/// attn_rows(q, kc, vc, out, slot, pos, slot_stride, q_stride, n_head, n_head_kv, hd, scale,
/// cap, window, sinks, out32): block (h, t) attends token t's query head over its slot's positions.
fn rows_attention(mem: &mut Memory, grid: (u32, u32), a: &Args) {
    let (stride, q_stride) = (a.long(6), a.int(7));
    let (nh, nkv, hd) = (a.int(8), a.int(9), a.int(10));
    let (scale, cap, window) = (a.float(11), a.float(12), a.int(13));
    let sinks = a.opt(14).map(|s| mem.f32s(s, nh));
    let row = nkv * hd;
    for t in 0..grid.1 as usize {
        let slot = mem.u32s(a.ptr(4) + 4 * t as u64, 1)[0] as usize;
        let len = mem.u32s(a.ptr(5) + 4 * t as u64, 1)[0] as usize + 1;
        let lo = if window > 0 {
            len.saturating_sub(window)
        } else {
            0
        };
        let base = 2 * (slot * stride) as u64;
        let (keys, values) = (
            mem.f16s(a.ptr(1) + base, len * row),
            mem.f16s(a.ptr(2) + base, len * row),
        );
        for h in 0..grid.0 as usize {
            let q = mem.f32s(a.ptr(0) + 4 * (t * q_stride + h * hd) as u64, hd);
            let kvh = h / (nh / nkv);
            let o = math::attend(
                &f16_round(&q),
                &keys,
                &values,
                row,
                kvh * hd,
                (lo, len),
                (scale, cap, sinks.as_ref().map(|s| s[h])),
            );
            // (f32 rows where out32 is given, the f16 ones otherwise)
            match a.opt(15) {
                Some(out32) => mem.write(out32 + 4 * ((t * nh + h) * hd) as u64, &o),
                None => mem.write_f16s(a.ptr(3) + 2 * ((t * nh + h) * hd) as u64, &o),
            }
        }
    }
}

fn f16_round(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect()
}

/// Router logits this close at the k-th choice may choose differently on any two backends:
/// the batched passes' router is an f16 GEMM, the CPU's a product on quantized activations.
const NEAR_TIE: f32 = 1e-2;

/// moe_route(logits, sel_bias, ids, weights, ne, k, gating, n_group, n_group_used, norm,
/// scale): a block per token; the tokens whose choice is a near tie are noted.
fn route(dev: &HostDevice, mem: &mut Memory, rows: usize, a: &Args) {
    let (ne, k) = (a.int(4), a.int(5));
    let routing = Routing {
        k,
        gating: a.int(6),
        groups: (a.int(7), a.int(8)),
        norm: a.int(9) == 1,
        scale: a.float(10),
    };
    let bias = a.opt(1).map(|b| mem.f32s(b, ne));
    for t in 0..rows {
        let logits = mem.f32s(a.ptr(0) + (4 * t * ne) as u64, ne);
        let (ids, w) = routing.route(&logits, bias.as_deref());
        if routing.margin(&logits, bias.as_deref()) < NEAR_TIE {
            dev.near_ties.borrow_mut().push(t);
        }
        mem.write(a.ptr(2) + (4 * t * k) as u64, &ids);
        mem.write(a.ptr(3) + (4 * t * k) as u64, &w);
        // The counters (a[11]), but for the padding rows (a[12]: each row's slot; a[13]:
        // the padding rows').
        let padding = a
            .opt(12)
            .is_some_and(|slots| mem.u32s(slots + 4 * t as u64, 1)[0] as usize == a.int(13));
        if let (Some(counts), false) = (a.opt(11), padding) {
            for &e in &ids {
                let at = counts + 4 * u64::from(e);
                let c = mem.u32s(at, 1)[0] + 1;
                mem.write(at, &[c]);
            }
        }
    }
}

/// moe_matvec(f)_T(W, expert_bytes, row_bytes, n_chunks, n_rows, x, x_stride, x_per, ids, y):
/// grid row j multiplies expert ids[j]'s rows by input j / x_per into output row j.
fn expert_products(dev: &HostDevice, mem: &mut Memory, name: &str, grid: (u32, u32), a: &Args) {
    let (expert_bytes, rb, cols, n_rows) = (a.long(1), a.int(2), 32 * a.int(3), a.int(4));
    let (x, stride, per) = (a.ptr(5), a.int(6), a.int(7));
    let (m, first) = dev.matrix(a.ptr(0));
    let spec = &dev.plan.matrices[m];
    assert!(name.ends_with(spec.kernel), "{name} for {}", spec.kernel);
    assert_eq!((rb, cols), (spec.row_bytes(), spec.cols));
    assert_eq!(expert_bytes, n_rows * rb, "an expert's rows");
    assert!(
        grid.0 as usize * MATVEC_ROWS >= n_rows,
        "{name}: rows left out"
    );
    assert!(
        a.opt(10).is_none(),
        "{name}: a batched pass's grid holds no shared expert"
    );
    for j in 0..grid.1 as usize {
        let e = mem.u32s(a.ptr(8) + 4 * j as u64, 1)[0] as usize;
        let input = mem.f32s(x + (4 * (j / per) * stride) as u64, cols);
        let y = products(dev, mem, a.ptr(0), first + e * n_rows, n_rows, &input);
        mem.write(a.ptr(9) + (4 * j * n_rows) as u64, &y);
    }
}

/// moe_combine(ys, w, k, d, shared, shared_gate, x, at): token t = grid row t adds its k
/// experts' outputs (row at[t * k + j], or t * k + j) times their weights, in slot order,
/// then the shared expert's output times sigmoid of its gate.
fn combine(mem: &mut Memory, grid: (u32, u32), block: u32, a: &Args) {
    let (k, d) = (a.int(2), a.int(3));
    let width = covered(grid, block, d);
    for t in 0..grid.1 as usize {
        let w = mem.f32s(a.ptr(1) + (4 * t * k) as u64, k);
        let out_row = |j: usize| match a.opt(7) {
            Some(at) => mem.u32s(at + (4 * (t * k + j)) as u64, 1)[0] as usize,
            None => t * k + j,
        };
        let ys: Vec<Vec<f32>> = (0..k)
            .map(|j| mem.f32s(a.ptr(0) + (4 * out_row(j) * d) as u64, d))
            .collect();
        let shared = a.opt(4).map(|s| mem.f32s(s + (4 * t * d) as u64, d));
        let gate = a.opt(5).map(|g| {
            let g = mem.f32s(g + 4 * t as u64, 1)[0];
            g / (1.0 + (-g).exp()) / g
        });
        let xr = a.ptr(6) + (4 * t * d) as u64;
        let mut x = mem.f32s(xr, d);
        for (i, x) in x.iter_mut().enumerate().take(width) {
            let mut o = ys[0][i] * w[0];
            for j in 1..k {
                o += ys[j][i] * w[j];
            }
            if let Some(sh) = &shared {
                o += gate.map_or(sh[i], |g| sh[i] * g);
            }
            *x += o;
        }
        mem.write(xr, &x);
    }
}

/// delta_conv_rows(in, in_stride, fused, w, state, pos0, out, channels, taps, key_dim, s,
/// ratio, n): the convolution along the batch's tokens, a thread per channel.
fn delta_conv_rows(mem: &mut Memory, a: &Args) {
    let (stride, fused, pos0) = (a.int(1), a.int(2) == 1, a.int(5));
    let (channels, taps, key_dim, s, ratio, n) = (
        a.int(7),
        a.int(8),
        a.int(9),
        a.int(10),
        a.int(11),
        a.int(12),
    );
    let shape = math::DeltaShape {
        hk: key_dim / s,
        hv: ratio * key_dim / s,
        s,
        tiled: false,
    };
    assert_eq!(shape.channels(), channels);
    let w = mem.f32s(a.ptr(3), channels * taps);
    let hist = (taps - 1) * channels;
    let mut state = if pos0 == 0 {
        vec![0.0; hist]
    } else {
        mem.f32s(a.ptr(4), hist)
    };
    for t in 0..n {
        let row = mem.f32s(a.ptr(0) + (4 * t * stride) as u64, stride);
        let x: Vec<f32> = (0..channels)
            .map(|c| row[shape.conv_source(c, fused)])
            .collect();
        let out = math::delta_conv(&mut state, &w, &x, taps);
        mem.write(a.ptr(6) + (4 * t * channels) as u64, &out);
    }
    mem.write(a.ptr(4), &state);
}

/// delta_rule_rows(conv, ba, ba_stride, alpha, dt_bias, ssm_a, norm, in_fused, z, z_stride,
/// state, pos0, out, hk, hv, s, tiled, eps, n): the recurrence along the batch's tokens, a
/// block per value head; the read-out as f16 rows.
fn delta_rule_rows(mem: &mut Memory, grid: (u32, u32), block: u32, a: &Args) {
    let shape = math::DeltaShape {
        hk: a.int(13),
        hv: a.int(14),
        s: a.int(15),
        tiled: a.int(16) == 1,
    };
    let (hv, s) = (shape.hv, shape.s);
    assert_eq!(
        (grid.0 as usize, block as usize),
        (hv, s),
        "a block per value head"
    );
    let (ba_stride, z_stride, pos0, eps, n) =
        (a.int(2), a.int(9), a.int(11), a.float(17), a.int(18));
    let channels = shape.channels();
    let [dt_bias, ssm_a, norm] = [(4, hv), (5, hv), (6, s)].map(|(i, len)| mem.f32s(a.ptr(i), len));
    let mut state = if pos0 == 0 {
        vec![0.0; hv * s * s]
    } else {
        mem.f32s(a.ptr(10), hv * s * s)
    };
    for t in 0..n {
        let conv = mem.f32s(a.ptr(0) + (4 * t * channels) as u64, channels);
        let (b, al, z) = row_gates(mem, a, shape, t, (ba_stride, z_stride));
        let vectors = (&dt_bias[..], &ssm_a[..], &norm[..]);
        let out = math::delta_rule(shape, &mut state, &conv, (&b, &al, &z), vectors, eps);
        mem.write_f16s(a.ptr(12) + (2 * t * hv * s) as u64, &out);
    }
    mem.write(a.ptr(10), &state);
}

/// Row `t`'s rates, decay inputs and output gates, from the fused rows or the split ones
/// (delta_rule_rows' and _slots' arguments 1-3 and 7-9).
fn row_gates(
    mem: &Memory,
    a: &Args,
    shape: math::DeltaShape,
    t: usize,
    (ba_stride, z_stride): (usize, usize),
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (b, al) = row_rates(mem, a, shape, t, ba_stride);
    (b, al, row_z(mem, a, shape, t, z_stride, [7, 8]))
}

/// Row `t`'s rates and decay inputs per value head (arguments 1-3: ba, its stride, alpha).
fn row_rates(
    mem: &Memory,
    a: &Args,
    shape: math::DeltaShape,
    t: usize,
    ba_stride: usize,
) -> (Vec<f32>, Vec<f32>) {
    let hv = shape.hv;
    let ba = mem.f32s(a.ptr(1) + (4 * t * ba_stride) as u64, ba_stride);
    match a.opt(3) {
        Some(alpha) => (ba[..hv].to_vec(), mem.f32s(alpha + (4 * t * hv) as u64, hv)),
        None => (0..hv).map(|vh| shape.fused_gates(&ba, vh)).unzip(),
    }
}

/// Row `t`'s output gates (arguments `fused` and `z`: the fused rows, or the split ones).
fn row_z(
    mem: &Memory,
    a: &Args,
    shape: math::DeltaShape,
    t: usize,
    z_stride: usize,
    [fused, z]: [usize; 2],
) -> Vec<f32> {
    let n = shape.hv * shape.s;
    match a.opt(z) {
        Some(z) => mem.f32s(z + (4 * t * z_stride) as u64, n),
        None => {
            let row = mem.f32s(a.ptr(fused) + (4 * t * z_stride) as u64, z_stride);
            (0..n).map(|i| shape.fused_z(&row, i)).collect()
        }
    }
}

/// delta_qk_norm_rows(conv, hk, s, channels, eps): grid (key heads, tokens), the queries and
/// keys L2-normalized in place.
fn delta_qk_norm_rows(mem: &mut Memory, grid: (u32, u32), block: u32, a: &Args) {
    let (hk, s, channels, eps) = (a.int(1), a.int(2), a.int(3), a.float(4));
    assert_eq!(
        (grid.0 as usize, block as usize),
        (hk, s),
        "a block per key head"
    );
    for t in 0..grid.1 as usize {
        let row = a.ptr(0) + (4 * t * channels) as u64;
        for at in (0..hk).flat_map(|kh| [kh * s, (hk + kh) * s]) {
            let x = math::l2_normalized(&mem.f32s(row + (4 * at) as u64, s), eps);
            mem.write(row + (4 * at) as u64, &x);
        }
    }
}

/// delta_chunk_gram(conv, gram, hk, s, channels, n): grid (key heads, chunks); per chunk and
/// key head `k_t . k_r` then `q_t . k_r` (64 x 64 each), summed in order from -0.0.
fn delta_chunk_gram(mem: &mut Memory, grid: (u32, u32), a: &Args) {
    const C: usize = 64;
    let (hk, s, channels, n) = (a.int(2), a.int(3), a.int(4), a.int(5));
    assert_eq!(
        (grid.0 as usize, grid.1 as usize),
        (hk, n.div_ceil(C)),
        "a block per key head and chunk"
    );
    let vec = |mem: &Memory, t: usize, at: usize| {
        mem.f32s(a.ptr(0) + (4 * (t * channels + at)) as u64, s)
    };
    for chunk in 0..n.div_ceil(C) {
        let (t0, l) = (chunk * C, C.min(n - chunk * C));
        for kh in 0..hk {
            let q: Vec<_> = (0..l).map(|t| vec(mem, t0 + t, kh * s)).collect();
            let k: Vec<_> = (0..l).map(|t| vec(mem, t0 + t, (hk + kh) * s)).collect();
            let dot =
                |x: &[f32], y: &[f32]| x.iter().zip(y).fold(-0.0f32, |acc, (x, y)| acc + x * y);
            let mut block = vec![0f32; 2 * C * C];
            for t in 0..l {
                for r in 0..l {
                    block[t * C + r] = dot(&k[t], &k[r]);
                    block[C * C + t * C + r] = dot(&q[t], &k[r]);
                }
            }
            let at = a.ptr(1) + (4 * (chunk * hk + kh) * 2 * C * C) as u64;
            mem.write(at, &block);
        }
    }
}

/// delta_rule_chunks(conv, ba, ba_stride, alpha, dt_bias, ssm_a, gram, state, pos0, out, hk,
/// hv, s, tiled, n): grid (value heads, columns / 32); the states through the chunks, the
/// read-outs (times 1 / sqrt(s)) as f32 rows; each sum in the kernel's order.
fn delta_rule_chunks(mem: &mut Memory, grid: (u32, u32), block: u32, a: &Args) {
    const C: usize = 64;
    let shape = math::DeltaShape {
        hk: a.int(10),
        hv: a.int(11),
        s: a.int(12),
        tiled: a.int(13) == 1,
    };
    let (hk, hv, s) = (shape.hk, shape.hv, shape.s);
    assert_eq!(
        (grid.0 as usize, grid.1 as usize, block),
        (hv, s / 32, 256),
        "a block per value head and 32 columns"
    );
    let (ba_stride, pos0, n) = (a.int(2), a.int(8), a.int(14));
    let (channels, key_dim, ratio) = (shape.channels(), hk * s, hv / hk);
    let [dt_bias, ssm_a] = [(4, hv), (5, hv)].map(|(i, len)| mem.f32s(a.ptr(i), len));
    let rates: Vec<_> = (0..n)
        .map(|t| row_rates(mem, a, shape, t, ba_stride))
        .collect();
    let scale = 1.0 / (s as f32).sqrt();
    for vh in 0..hv {
        let kh = if shape.tiled { vh % hk } else { vh / ratio };
        let at = a.ptr(7) + (4 * vh * s * s) as u64;
        let mut st = if pos0 == 0 {
            vec![0.0; s * s]
        } else {
            mem.f32s(at, s * s)
        };
        for chunk in 0..n.div_ceil(C) {
            let (t0, l) = (chunk * C, C.min(n - chunk * C));
            let row = |t: usize, off: usize| {
                mem.f32s(a.ptr(0) + (4 * ((t0 + t) * channels + off)) as u64, s)
            };
            let q: Vec<_> = (0..l).map(|t| row(t, kh * s)).collect();
            let k: Vec<_> = (0..l).map(|t| row(t, key_dim + kh * s)).collect();
            let v: Vec<_> = (0..l).map(|t| row(t, 2 * key_dim + vh * s)).collect();
            let gram = mem.f32s(
                a.ptr(6) + (4 * (chunk * hk + kh) * 2 * C * C) as u64,
                2 * C * C,
            );
            let (kk, qk) = gram.split_at(C * C);
            let (mut beta, mut cum) = (vec![0f32; l], vec![0f32; l]);
            let mut acc = 0f32;
            for t in 0..l {
                let (b, al) = (&rates[t0 + t].0, &rates[t0 + t].1);
                let (bt, g) = math::rate_and_log_decay(b[vh], al[vh], dt_bias[vh], ssm_a[vh]);
                beta[t] = bt;
                acc += g;
                cum[t] = acc;
            }
            // S0^T x over the state's rows in order from 0.
            let state_dot = |st: &[f32], x: &[f32], j: usize| {
                (0..s).fold(0f32, |acc, i| acc + x[i] * st[i * s + j])
            };
            let mut u = vec![vec![0f32; s]; l];
            for t in 0..l {
                for j in 0..s {
                    u[t][j] = beta[t] * (v[t][j] - cum[t].exp() * state_dot(&st, &k[t], j));
                }
            }
            for t in 1..l {
                let (done, rest) = u.split_at_mut(t);
                for (j, x) in rest[0].iter_mut().enumerate() {
                    for (r, ur) in done.iter().enumerate() {
                        *x += -((beta[t] * (cum[t] - cum[r]).exp()) * kk[t * C + r]) * ur[j];
                    }
                }
            }
            for t in 0..l {
                let mut o: Vec<f32> = (0..s)
                    .map(|j| cum[t].exp() * state_dot(&st, &q[t], j))
                    .collect();
                for (j, o) in o.iter_mut().enumerate() {
                    for r in 0..=t {
                        *o += ((cum[t] - cum[r]).exp() * qk[t * C + r]) * u[r][j];
                    }
                    *o *= scale;
                }
                let out = a.ptr(9) + (4 * ((t0 + t) * hv * s + vh * s)) as u64;
                mem.write(out, &o);
            }
            let total = cum[l - 1].exp();
            for i in 0..s {
                for j in 0..s {
                    let mut x = st[i * s + j] * total;
                    for r in 0..l {
                        x += ((cum[l - 1] - cum[r]).exp() * k[r][i]) * u[r][j];
                    }
                    st[i * s + j] = x;
                }
            }
        }
        mem.write(at, &st);
    }
}

/// delta_gated_norm_rows(o, in_fused, z, z_stride, norm, out, hv, s, ratio, eps): grid (value
/// heads, tokens); rms_norm(o) * norm * silu(z) as f16 rows.
fn delta_gated_norm_rows(mem: &mut Memory, grid: (u32, u32), block: u32, a: &Args) {
    let (z_stride, hv, s, ratio, eps) = (a.int(3), a.int(6), a.int(7), a.int(8), a.float(9));
    assert_eq!(
        (grid.0 as usize, block as usize),
        (hv, s),
        "a block per value head"
    );
    let shape = math::DeltaShape {
        hk: hv / ratio,
        hv,
        s,
        tiled: false,
    };
    let norm = mem.f32s(a.ptr(4), s);
    for t in 0..grid.1 as usize {
        let z = row_z(mem, a, shape, t, z_stride, [1, 2]);
        let o = mem.f32s(a.ptr(0) + (4 * t * hv * s) as u64, hv * s);
        let mut y = Vec::with_capacity(hv * s);
        for (vh, head) in o.chunks(s).enumerate() {
            let normed = math::rms_norm(head, Some(&norm), eps);
            y.extend(normed.iter().enumerate().map(|(j, x)| {
                let zv = z[vh * s + j];
                x * (zv / (1.0 + (-zv).exp()))
            }));
        }
        mem.write_f16s(a.ptr(5) + (2 * t * hv * s) as u64, &y);
    }
}

/// delta_conv_slots(in, in_stride, fused, w, conv_state, conv_stride, slot, pos, out,
/// channels, taps, key_dim, s, ratio): grid (channel blocks, rows), row t its slot's state.
fn delta_conv_slots(mem: &mut Memory, grid: (u32, u32), a: &Args) {
    let (stride, fused, state_stride) = (a.int(1), a.int(2) == 1, a.long(5));
    let (channels, taps, key_dim, s, ratio) =
        (a.int(9), a.int(10), a.int(11), a.int(12), a.int(13));
    let shape = math::DeltaShape {
        hk: key_dim / s,
        hv: ratio * key_dim / s,
        s,
        tiled: false,
    };
    let rows = grid.1 as usize;
    let (slots, pos) = (mem.u32s(a.ptr(6), rows), mem.u32s(a.ptr(7), rows));
    let w = mem.f32s(a.ptr(3), channels * taps);
    let hist = (taps - 1) * channels;
    for t in 0..rows {
        let at = a.ptr(4) + (4 * slots[t] as usize * state_stride) as u64;
        let mut state = if pos[t] == 0 {
            vec![0.0; hist]
        } else {
            mem.f32s(at, hist)
        };
        let row = mem.f32s(a.ptr(0) + (4 * t * stride) as u64, stride);
        let x: Vec<f32> = (0..channels)
            .map(|c| row[shape.conv_source(c, fused)])
            .collect();
        let out = math::delta_conv(&mut state, &w, &x, taps);
        mem.write(at, &state);
        mem.write(a.ptr(8) + (4 * t * channels) as u64, &out);
    }
}

/// delta_rule_slots(conv, ba, ba_stride, alpha, dt_bias, ssm_a, norm, in_fused, z, z_stride,
/// ssm_state, ssm_stride, slot, pos, out, hk, hv, s, tiled, eps): grid (value heads, rows).
fn delta_rule_slots(mem: &mut Memory, grid: (u32, u32), block: u32, a: &Args) {
    let shape = math::DeltaShape {
        hk: a.int(15),
        hv: a.int(16),
        s: a.int(17),
        tiled: a.int(18) == 1,
    };
    let (hv, s) = (shape.hv, shape.s);
    assert_eq!(
        (grid.0 as usize, block as usize),
        (hv, s),
        "a block per value head"
    );
    let (ba_stride, z_stride, state_stride, eps) = (a.int(2), a.int(9), a.long(11), a.float(19));
    let channels = shape.channels();
    let [dt_bias, ssm_a, norm] = [(4, hv), (5, hv), (6, s)].map(|(i, len)| mem.f32s(a.ptr(i), len));
    let rows = grid.1 as usize;
    let (slots, pos) = (mem.u32s(a.ptr(12), rows), mem.u32s(a.ptr(13), rows));
    for t in 0..rows {
        let at = a.ptr(10) + (4 * slots[t] as usize * state_stride) as u64;
        let mut state = if pos[t] == 0 {
            vec![0.0; hv * s * s]
        } else {
            mem.f32s(at, hv * s * s)
        };
        let conv = mem.f32s(a.ptr(0) + (4 * t * channels) as u64, channels);
        let (b, al, z) = row_gates(mem, a, shape, t, (ba_stride, z_stride));
        let vectors = (&dt_bias[..], &ssm_a[..], &norm[..]);
        let out = math::delta_rule(shape, &mut state, &conv, (&b, &al, &z), vectors, eps);
        mem.write(at, &state);
        mem.write_f16s(a.ptr(14) + (2 * t * hv * s) as u64, &out);
    }
}
