"""Checks of the fused mixture-of-experts kernels (pellucid.kernels.fused_moe) against the torch code of
pellucid.models.moe, runnable on a GPU or, on the CPU, under the Triton interpreter (TRITON_INTERPRET=1
set before triton is imported).

`python tests/gpu/moe_checks.py DEVICE [PART]` runs the checks and exits non-zero on the first mismatch.
"""
from __future__ import annotations

import os
import sys
import time

import torch

if __name__ == "__main__":     # run as a script (under the interpreter): make `tests` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.gpu.check_support import assert_close  # noqa: E402


def _spec(num_experts: int, top_k: int, renormalize: bool, round_weights: bool):
    from pellucid.models.moe import MoeSpec
    return MoeSpec(num_experts, top_k, renormalize, round_weights)


def check_routing(device: str, seed: int, cases: list[tuple[int, int, int]]) -> None:
    """Expert choices equal a stable descending sort of the logits (equal logits, common in bf16: the lowest
    expert index first) and the weights equal the torch routing's arithmetic on them."""
    from pellucid.kernels.fused_moe import route_and_align
    g = torch.Generator().manual_seed(seed)
    for num_tokens, num_experts, top_k in cases:
        for renormalize, dtype in ((True, torch.float32), (False, torch.bfloat16)):
            spec = _spec(num_experts, top_k, renormalize, True)
            logits = (torch.randn(num_tokens, num_experts, generator=g) * 2).to(dtype).to(device)
            ids, weights, layout = route_and_align(logits, spec)
            expected = torch.sort(logits.cpu().float(), dim=1, descending=True, stable=True).indices[:, :top_k]
            what = f"routing T={num_tokens} E={num_experts} k={top_k} renorm={renormalize} {dtype}"
            assert torch.equal(ids.cpu().long(), expected), what
            probs = torch.softmax(logits.cpu().float(), dim=-1).gather(1, expected)
            if renormalize:
                probs = probs / probs.sum(dim=-1, keepdim=True)
            tol = 1e-6 if dtype == torch.float32 else 1e-2
            assert weights.dtype == dtype and (weights.cpu().float() - probs.to(dtype).float()).abs().max() <= tol, what
            check_layout(layout, ids.cpu().long(), num_experts, what)
            # Ties everywhere: logits on a coarse grid.
            tied = (torch.randint(0, 4, (num_tokens, num_experts), generator=g).float() / 4).to(device)
            ids, _, layout = route_and_align(tied, _spec(num_experts, top_k, renormalize, False))
            expected = torch.sort(tied.cpu(), dim=1, descending=True, stable=True).indices[:, :top_k]
            assert torch.equal(ids.cpu().long(), expected), f"ties: {what}"
            check_layout(layout, ids.cpu().long(), num_experts, f"ties: {what}")


def check_layout(layout, ids: torch.Tensor, num_experts: int, what: str) -> None:
    """Brute force: every entry sits exactly once in a block of its expert, blocks are filled from the start,
    experts in increasing order, and the blocks past the last one are marked -1."""
    block_m = layout.block_m
    experts = layout.block_expert.cpu().tolist()
    rows = layout.block_rows.cpu().tolist()
    slots = layout.sorted_entries.cpu()
    flat = ids.flatten()
    seen = []
    used = [b for b, e in enumerate(experts) if e >= 0]
    assert used == list(range(len(used))), f"{what}: used blocks are not a prefix {experts}"
    assert [experts[b] for b in used] == sorted(experts[b] for b in used), f"{what}: experts out of order"
    for b in used:
        assert 0 < rows[b] <= block_m, f"{what}: block {b} has {rows[b]} rows"
        for i in range(rows[b]):
            entry = int(slots[b * block_m + i])
            assert int(flat[entry]) == experts[b], f"{what}: entry {entry} in a block of expert {experts[b]}"
            seen.append(entry)
    assert sorted(seen) == list(range(flat.numel())), f"{what}: entries missing or repeated"
    for e in range(num_experts):
        count = int((flat == e).sum())
        assert sum(1 for b in used if experts[b] == e) == (count + block_m - 1) // block_m, f"{what}: blocks of {e}"
    assert all(rows[b] == 0 for b in range(len(experts)) if experts[b] < 0)


def _experts(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, device: str, g: torch.Generator):
    from pellucid.models.moe import FusedExperts
    experts = FusedExperts(num_experts, hidden, inter, dtype, device)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden ** 0.5)
        experts.down_proj.copy_(torch.randn(num_experts, hidden, inter, generator=g) / inter ** 0.5)
    return experts


def _reference(experts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """transformers' expert arithmetic (each expert's output and its weighted product rounded to x's dtype),
    the top-k contributions summed in float32 and rounded once, as the kernels do (transformers adds them one
    by one in x's dtype, which in bfloat16 moves the sum by a few roundings more)."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        out.index_add_(0, token, (experts._expert(x[token], e) * weights[token, slot, None]).to(x.dtype).float())
    return out.to(x.dtype)


def check_experts(device: str, seed: int, cases: list[tuple[int, int, int, int, int]], dtypes) -> None:
    """fused_experts against the torch expert loop, with the layout from the routing kernel, a layout made
    from given int64 ids (the traced path), and every tile family for activations in the model's dtype."""
    from pellucid.kernels import fused_moe
    g = torch.Generator().manual_seed(seed)
    for num_tokens, num_experts, top_k, hidden, inter in cases:
        for dtype in dtypes:
            experts = _experts(num_experts, hidden, inter, dtype, device, g)
            spec = _spec(num_experts, top_k, seed % 2 == 0, dtype != torch.float32)
            x = torch.randn(num_tokens, hidden, generator=g).to(dtype).to(device)
            logits = (torch.randn(num_tokens, num_experts, generator=g) * 2).to(dtype).to(device)
            ids, weights, layout = fused_moe.route_and_align(logits, spec)
            cpu = experts.to("cpu")
            ref = _reference(cpu, x.cpu(), ids.cpu().long(), weights.cpu())
            experts = cpu.to(device)
            what = f"experts T={num_tokens} E={num_experts} k={top_k} H={hidden} I={inter} {dtype}"
            weight_args = (experts.gate_up_proj, experts.down_proj)
            out = fused_moe.fused_experts(x, *weight_args, ids, weights, layout)
            assert_close(out.cpu(), ref, dtype, what)
            assert_close(fused_moe.fused_experts(x, *weight_args, ids.long(), weights).cpu(), ref, dtype,
                         f"{what} (int64 ids, own layout)")
            for tiles in fused_moe.PLAIN_ACTIVATION_TILES:
                assert_close(fused_moe.fused_experts(x, *weight_args, ids, weights, None, tiles).cpu(), ref, dtype,
                             f"{what} {tiles}")
            print(f"{what}: equal to the torch loop with every tile family", flush=True)


def check_fp8_experts(device: str, seed: int, cases, dtypes) -> None:
    """Experts kept as float8 codes with block scales (pellucid.models.fp8_experts) against the same experts
    dequantized first (code * scale in float32, rounded to the dtype): bit for bit in float32, within the dtype's
    rounding in 16 bits (the compiled 8-bit operand sums its K products in another order: moe_gemm.py; the
    interpreter truncates to 16 bits instead of rounding); every tile family for unquantized activations, both
    layouts, and the torch loop of the FP8 module against the dequantized module's (bit for bit)."""
    from pellucid.kernels import fused_moe
    from pellucid.models.fp8_experts import dequantize, quantize
    from pellucid.models.moe import FusedExperts
    g = torch.Generator().manual_seed(seed)
    for num_tokens, num_experts, top_k, hidden, inter, block in cases:
        for dtype in dtypes:
            fp8 = FusedExperts(num_experts, hidden, inter, dtype, device, fp8_block=block)
            plain = FusedExperts(num_experts, hidden, inter, dtype, device)
            with torch.no_grad():
                for name, (rows, cols) in (("gate_up_proj", (2 * inter, hidden)), ("down_proj", (hidden, inter))):
                    codes, scales = quantize(torch.randn(num_experts, rows, cols, generator=g) / cols ** 0.5, block)
                    # scales spread over two decades: a wrong block's scale shows
                    scales = scales * torch.exp(torch.randn(scales.shape, generator=g))
                    getattr(fp8, name).copy_(codes.to(device))
                    getattr(fp8, name + "_scale_inv").copy_(scales.to(device))
                    getattr(plain, name).copy_(dequantize(codes, scales, dtype).to(device))
            spec = _spec(num_experts, top_k, seed % 2 == 0, dtype != torch.float32)
            x = torch.randn(num_tokens, hidden, generator=g).to(dtype).to(device)
            logits = (torch.randn(num_tokens, num_experts, generator=g) * 2).to(dtype).to(device)
            ids, weights, layout = fused_moe.route_and_align(logits, spec)
            what = f"fp8 experts T={num_tokens} E={num_experts} k={top_k} H={hidden} I={inter} block={block} {dtype}"
            # Bit for bit in float32 where the K tiles are the plain experts' (a scale block narrower than a tile
            # makes the K tile narrower, which sums in another order).
            exact = dtype == torch.float32 and block[1] % 128 == 0

            def check(got: torch.Tensor, want: torch.Tensor, label: str) -> None:
                if exact:
                    assert torch.equal(got, want), f"{what} {label}: not bit-equal to the dequantized experts"
                else:
                    assert_close(got.cpu(), want.cpu(), dtype, f"{what} {label}")

            check(fp8(x, ids, weights, layout), plain(x, ids, weights, layout), "routing layout")
            check(fp8(x, ids.long(), weights), plain(x, ids.long(), weights), "own layout")
            for tiles in fused_moe.PLAIN_ACTIVATION_TILES:
                got = fused_moe.fused_experts(x, fp8.gate_up_proj, fp8.down_proj, ids, weights, None, tiles,
                                              fp8.gate_up_proj_scale_inv, fp8.down_proj_scale_inv)
                check(got, fused_moe.fused_experts(x, plain.gate_up_proj, plain.down_proj, ids, weights, None, tiles),
                      str(tiles))
            cpu_x, cpu_ids, cpu_weights = x.cpu(), ids.cpu().long(), weights.cpu()
            assert torch.equal(fp8.to("cpu")._forward_loop(cpu_x, cpu_ids, cpu_weights),
                               plain.to("cpu")._forward_loop(cpu_x, cpu_ids, cpu_weights)), f"{what} torch loop"
            print(f"{what}: equal to the dequantized experts ({'bit for bit' if exact else 'within rounding'})",
                  flush=True)


def _w8a8_reference(x, gate_up, gate_up_scale, down, down_scale, ids, weights) -> torch.Tensor:
    """W8A8 by brute force, in float64 on the CPU: x and each expert's SiLU-and-mul output quantized per token and
    group of the weight block's K side (pellucid.models.fp8_experts.quantize_activations), times the dequantized
    weights (code * scale), rounded to x's dtype where the kernels round (each GEMM's output, silu, the product,
    the weighted row, the top-k sum in float32)."""
    from pellucid.models.fp8_experts import dequantize, fake_quantized_activations
    x, ids, weights = x.cpu(), ids.cpu().long(), weights.cpu()
    dtype, inter = x.dtype, down.shape[2]
    group_in, group_mid = x.shape[1] // gate_up_scale.shape[2], inter // down_scale.shape[2]
    xq = fake_quantized_activations(x, group_in).double()
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        gu = dequantize(gate_up[e].cpu(), gate_up_scale[e].cpu(), torch.float32).double()
        dn = dequantize(down[e].cpu(), down_scale[e].cpu(), torch.float32).double()
        h = (xq[token] @ gu.T).to(dtype).float()
        act = (torch.nn.functional.silu(h[:, :inter]).to(dtype).float() * h[:, inter:]).to(dtype)
        y = (fake_quantized_activations(act, group_mid).double() @ dn.T).to(dtype).float()
        out.index_add_(0, token, (y * weights[token, slot, None].float()).to(dtype).float())
    return out.to(dtype)


def check_fp8_activations(device: str, seed: int, cases, dtypes, every_tile_up_to: int) -> None:
    """W8A8 experts (float8 weights with block scales times float8 activations, fused_experts with
    quantize_activations) against the brute-force reference above, with the routing's layout and every tile
    family. Their float32 sums run in another order than the reference's (on Hopper the tensor cores also add an
    FP8 product's terms at reduced precision within each 128-deep K step), and a 16-bit rounding moved by that
    can move an activation's float8 code by one step, so the bound is looser than the plain experts'; the W8A16
    result (the same weights, activations unquantized) must miss the reference by at least twice the worst error.
    Cases of more than `every_tile_up_to` tokens run the default tiles only (the interpreter's time)."""
    from pellucid.kernels import fused_moe
    from pellucid.models.fp8_experts import quantize
    g = torch.Generator().manual_seed(seed)
    for num_tokens, num_experts, top_k, hidden, inter, block in cases:
        for dtype in dtypes:
            weights_of = {}
            for name, (rows, cols) in (("gate_up", (2 * inter, hidden)), ("down", (hidden, inter))):
                codes, scales = quantize(torch.randn(num_experts, rows, cols, generator=g) / cols ** 0.5, block)
                spread = scales * torch.exp(torch.randn(scales.shape, generator=g))
                weights_of[name] = (codes.to(device), spread.to(device))
            (gate_up, gate_up_scale), (down, down_scale) = weights_of["gate_up"], weights_of["down"]
            spec = _spec(num_experts, top_k, seed % 2 == 0, dtype != torch.float32)
            x = torch.randn(num_tokens, hidden, generator=g).to(dtype).to(device)
            logits = (torch.randn(num_tokens, num_experts, generator=g) * 2).to(dtype).to(device)
            ids, weights, layout = fused_moe.route_and_align(logits, spec)
            want = _w8a8_reference(x, gate_up, gate_up_scale, down, down_scale, ids, weights).double()
            what = f"W8A8 experts T={num_tokens} E={num_experts} k={top_k} H={hidden} I={inter} block={block} {dtype}"
            limit = 5e-3 if dtype == torch.float32 else 1.5e-2
            rel = lambda got: ((got.cpu().double() - want).norm() / want.norm()).item()  # noqa: E731
            errors = []
            for tiles in (None,) + (fused_moe.ALL_TILES if num_tokens <= every_tile_up_to else ()):
                got = fused_moe.fused_experts(x, gate_up, down, ids, weights, layout if tiles is None else None, tiles,
                                              gate_up_scale, down_scale, quantize_activations=True)
                errors.append(rel(got))
                assert errors[-1] < limit, f"{what} {tiles}: relative error {errors[-1]:.3g} >= {limit}"
            w8a16 = fused_moe.fused_experts(x, gate_up, down, ids, weights, layout, None, gate_up_scale, down_scale)
            print(f"{what}: worst relative error {max(errors):.3g} (bound {limit}), W8A16's {rel(w8a16):.3g}")
            assert rel(w8a16) > 2 * max(errors), f"{what}: W8A16 is within {rel(w8a16):.3g} of the W8A8 reference"


def check_deep_activation_groups_refused(device: str) -> None:
    """W8A8 with weight blocks 256 deep along K is a clear error (the tiles' pipelines hold K steps of at most 128),
    not a launch that runs out of shared memory."""
    from pellucid.kernels import fused_moe
    from pellucid.models.fp8_experts import quantize
    g = torch.Generator().manual_seed(0)
    gate_up, gate_up_scale = quantize(torch.randn(4, 256, 256, generator=g), (128, 256))
    down, down_scale = quantize(torch.randn(4, 256, 128, generator=g), (128, 128))
    ids = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device)
    weights = torch.full((2, 2), 0.5, device=device)
    x = torch.randn(2, 256, generator=g).to(device)
    try:
        fused_moe.fused_experts(x, gate_up.to(device), down.to(device), ids, weights, None, None,
                                gate_up_scale.to(device), down_scale.to(device), quantize_activations=True)
    except ValueError as e:
        assert "16-128" in str(e), e
    else:
        raise AssertionError("W8A8 with 256-deep weight blocks ran")


def check_block(device: str, seed: int) -> None:
    """The whole SparseMoeBlock (router GEMM, fused routing and experts, Qwen2's shared expert) against
    its torch path, traced (routing observed) and not."""
    from pellucid.models.moe import SparseMoeBlock
    g = torch.Generator().manual_seed(seed)
    for shared in (0, 48):
        spec = _spec(8, 2, True, True)
        block = SparseMoeBlock(spec, 64, 32, shared, torch.float32, "cpu")
        with torch.no_grad():
            for p in block.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        x = torch.randn(11, 64, generator=g)
        with torch.no_grad():
            ref = block(x)
            block.to(device)
            out = block(x.to(device))
            assert_close(out.cpu(), ref, torch.float32, f"SparseMoeBlock shared={shared}")
            seen = []
            handle = block.routing.register_forward_hook(lambda m, a, o: seen.append(o))
            traced = block(x.to(device))
            handle.remove()
            assert len(seen) == 1 and seen[0].shape == (11, 8)
            assert_close(traced.cpu(), ref, torch.float32, f"SparseMoeBlock shared={shared} routing observed")


CPU_PARTS = ("routing", "experts", "fp8", "a8")   # "block" needs CUDA (the model only dispatches there)
GPU_PARTS = ("routing", "experts", "fp8", "a8", "block")


def run_part(device: str, part: str) -> None:
    on_cpu = device == "cpu"
    if part == "routing":
        cases = [(1, 8, 2), (1, 6, 3), (5, 6, 3), (9, 16, 1)] if on_cpu else \
            [(1, 128, 8), (1, 60, 5), (7, 60, 4), (64, 128, 8), (65, 128, 8), (300, 128, 8), (1000, 8, 2),
             (4096, 64, 6)]
        for seed in range(2):
            check_routing(device, seed, cases)
    elif part == "experts":
        cases = [(1, 8, 2, 64, 32), (6, 4, 2, 80, 48), (70, 8, 2, 64, 32)] if on_cpu else \
            [(1, 128, 8, 2048, 768), (3, 60, 4, 256, 200), (64, 128, 8, 512, 256), (256, 128, 8, 512, 256),
             (1000, 16, 2, 256, 384), (512, 128, 8, 2048, 768)]
        # The interpreter truncates to 16 bits instead of rounding: float16's finer mantissa keeps that small.
        dtypes = (torch.float32, torch.float16) if on_cpu else (torch.float32, torch.bfloat16)
        for seed in range(2):
            check_experts(device, seed, cases, dtypes)
    elif part == "fp8":
        cases = [(1, 8, 2, 128, 128, (16, 128)), (6, 4, 2, 128, 128, (32, 128)), (70, 8, 2, 128, 128, (128, 128)),
                 (3, 8, 2, 64, 32, (8, 16))] if on_cpu else \
            [(1, 128, 8, 2048, 768, (128, 128)), (3, 60, 4, 256, 192, (64, 64)), (300, 16, 2, 256, 384, (64, 128))]
        dtypes = (torch.float32, torch.float16) if on_cpu else (torch.float32, torch.bfloat16)
        check_fp8_experts(device, 0, cases, dtypes)
    elif part == "a8":
        cases = [(1, 8, 2, 128, 128, (16, 128)), (70, 8, 2, 128, 256, (128, 128)), (3, 8, 2, 64, 32, (8, 16))] \
            if on_cpu else [(1, 128, 8, 2048, 768, (128, 128)), (64, 128, 8, 2048, 768, (128, 128)),
                            (3, 60, 4, 256, 192, (64, 64)), (1024, 128, 8, 2048, 768, (128, 128))]
        dtypes = (torch.float32, torch.float16) if on_cpu else (torch.float32, torch.bfloat16)
        check_fp8_activations(device, 0, cases, dtypes, 1 if on_cpu else 1 << 30)
        check_deep_activation_groups_refused(device)
    elif part == "block":
        for seed in range(2):
            check_block(device, seed)
    else:
        raise ValueError(part)


if __name__ == "__main__":
    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    for name in sys.argv[2:] or CPU_PARTS:
        started = time.perf_counter()
        run_part(device, name)
        print(f"part {name} passed in {time.perf_counter() - started:.1f} s", flush=True)
    print("moe checks passed")
