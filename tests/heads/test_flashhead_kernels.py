"""FlashHead's Triton kernels against float64 references: on CPU through the Triton interpreter (in a
subprocess, since TRITON_INTERPRET must be set before triton is imported), and on CUDA when present."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from pellucid.heads.flashhead import kernels

CHECK = textwrap.dedent("""
    import torch
    from pellucid.heads.flashhead import kernels as k

    def ref_stage1(h, cent, scale, noise):
        return (h.to(cent.dtype).double() @ cent.double().T) * scale.double()[:, None] + noise.double()

    def ref_stage2(h, w, ids, clusters):
        rows, probes = clusters.shape
        logits = torch.einsum("rpsh,rh->rps", w[clusters].double(), h.double()).reshape(rows, -1)
        tokens = ids[clusters].reshape(rows, -1)
        return logits.masked_fill(tokens < 0, float("-inf")), tokens

    device = "{device}"
    for seed in (0, 1, 2):
        torch.manual_seed(seed)
        for dtype in (torch.float32, torch.bfloat16):
            rows, clusters, size, hidden, probes = 3 + seed, 37, 6 + 5 * seed, 40 + 8 * seed, 5
            h = torch.randn(rows, hidden, device=device).to(dtype)
            cent = torch.randn(clusters, hidden, device=device).to(dtype)
            scale, noise = torch.rand(rows, device=device) + 0.5, torch.randn(rows, clusters, device=device)
            got = k.stage1_triton(h, cent, scale, noise, block_c=16, block_h=16).double()
            want = ref_stage1(h, cent, scale, noise)
            err = float((got - want).norm() / want.norm())
            assert err < 1e-5, ("stage1", dtype, err)
            w = torch.randn(clusters, size, hidden, device=device).to(dtype)
            ids = torch.randint(-1, 1000, (clusters, size), device=device)
            chosen = torch.randint(0, clusters, (rows, probes), device=device)
            logits, tokens = k.stage2_triton(h, w, ids, chosen, block_p=2, block_h=16)
            want_logits, want_tokens = ref_stage2(h, w, ids, chosen)
            assert torch.equal(tokens, want_tokens)
            assert torch.equal(torch.isinf(logits), torch.isinf(want_logits))
            finite = torch.isfinite(want_logits)
            err = float((logits.double()[finite] - want_logits[finite]).norm() / want_logits[finite].norm())
            assert err < 1e-5, ("stage2", dtype, err)
            keys = torch.randn(rows, 300, device=device)
            keys[0, 10:20] = 0.5                     # ties at the threshold: the lowest ids win
            keys[-1] = keys[-1].round()
            crowded = (torch.randn(2, 9000 + 500 * seed, device=device) * 2).round() / 2  # buckets > 512 keys
            # several select programs per row; the second row's threshold bucket holds ~300 keys (ranked in
            # more than one tile), with ties among them
            spread = torch.randn(2, 5000 + 300 * seed, device=device)
            spread[1] = -spread[1].abs() - 1
            spread[1, 7::16] = 1.0 + (torch.rand(spread[1, 7::16].shape, device=device) * 10).round() / 100
            for probes, batch in ([(p, keys) for p in (1, 7, 64, 299)] + [(p, crowded) for p in (1, 700, 2999)]
                                  + [(p, spread) for p in (1, 100, 256, 2500)]):
                got = k.select_triton(batch, probes, num_warps=4)
                for r in range(batch.shape[0]):
                    g, kth = got[r].sort().values, batch[r].topk(probes).values[-1]   # order unspecified
                    assert g.unique().numel() == probes
                    assert bool((batch[r][g] >= kth).all())
                    tied = (batch[r] == kth).nonzero().squeeze(1)
                    assert torch.equal(g[batch[r][g] == kth], tied[:probes - int((batch[r] > kth).sum())])
            # Stage 1 builds the select's first-digit histogram on the fly, equal to the standalone one.
            histogram = k.selection_histogram(rows, device)
            got = k.stage1_triton(h, cent, scale, noise, block_c=16, block_h=16, histogram=histogram)
            assert torch.equal(histogram, k.histogram_triton(got))
            picked = k.select_from_histogram_triton(got, histogram, 5).sort(dim=1).values
            assert torch.equal(picked, got.topk(5, dim=1).indices.sort(dim=1).values)
            # Greedy stage 2 (fused argmax): equal to the argmax over stage 2's logits, ties (duplicate
            # rows) going to the lowest token id; the select kernel resets the accumulators first.
            w[1, 1] = w[2, 0]
            chosen[:, :2] = torch.tensor([1, 2], device=device)
            state = k.greedy_state(rows, device)
            k.stage1_triton(h, cent, None, None, block_c=16, block_h=16, state=state)
            assert bool((state[0] == torch.iinfo(torch.int64).min).all()) and int(state[1].abs().sum()) == 0
            tokens = k.stage2_greedy_triton(h, w, ids, chosen, state, block_p=2, block_h=16)
            assert torch.equal(tokens, k.argmax_tokens(*ref_stage2(h, w, ids, chosen))), ("greedy", dtype)
            for probes in (3, 37):
                got = k.greedy_tokens(h, cent, w, ids, probes, torch.arange(37, device=device)[None])
                clusters = ref_stage1(h, cent, torch.ones(rows, device=device), torch.zeros(rows, 37, device=device))
                want = k.argmax_tokens(*ref_stage2(h, w, ids, clusters.topk(probes, dim=1).indices))
                assert torch.equal(got, want), ("greedy_tokens", probes, got, want)
    print("kernels ok")
""")


@pytest.mark.skipif(not kernels.triton_available(), reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: the kernels are checked on the device instead")
def test_triton_kernels_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run([sys.executable, "-c", CHECK.format(device="cpu")], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "kernels ok" in result.stdout


@pytest.mark.skipif(not torch.cuda.is_available() or not kernels.triton_available(), reason="needs CUDA and triton")
def test_triton_kernels_on_cuda():
    exec(compile(CHECK.format(device="cuda"), "flashhead_kernel_check", "exec"), {})


def test_torch_stages_match_float64_reference():
    for seed in (0, 1, 2):
        torch.manual_seed(seed)
        h, cent = torch.randn(4, 24), torch.randn(9, 24)
        scale, noise = torch.rand(4) + 0.5, torch.randn(4, 9)
        want = (h.double() @ cent.double().T) * scale.double()[:, None] + noise.double()
        torch.testing.assert_close(kernels.stage1_torch(h, cent, scale, noise).double(), want, rtol=1e-5, atol=1e-4)
        w, ids = torch.randn(9, 4, 24), torch.randint(-1, 50, (9, 4))
        chosen = torch.randint(0, 9, (4, 3))
        logits, tokens = kernels.stage2_torch(h, w, ids, chosen)
        for r in range(4):
            for j, c in enumerate(chosen[r].tolist()):
                for s in range(4):
                    col = j * 4 + s
                    assert tokens[r, col] == ids[c, s]
                    if ids[c, s] < 0:
                        assert logits[r, col] == float("-inf")
                    else:
                        assert abs(float(logits[r, col]) - float(w[c, s].double() @ h[r].double())) < 1e-4


@pytest.mark.skipif(not torch.cuda.is_available() or not kernels.triton_available(), reason="needs CUDA and triton")
def test_flashhead_on_cuda_is_exact_retrieval_and_graph_capturable(tmp_path):
    from pellucid.heads.flashhead import FlashHead
    from pellucid.heads.flashhead.asset import save_asset
    from pellucid.heads.flashhead.clustering import PAD_TOKEN, balanced_spherical_kmeans

    for seed in (0, 1, 2):
        torch.manual_seed(seed)
        weight = torch.randn(3000, 128, device="cuda")
        clustering = balanced_spherical_kmeans(weight, cluster_size=16, iterations=3, seed=seed, progress=False)
        path = save_asset(str(tmp_path / f"a{seed}.safetensors"), clustering, weight)
        full = FlashHead(weight, {"asset": path, "probes": clustering.token_ids.shape[0]})
        hidden = torch.randn(16, 128, device="cuda")
        logits = hidden @ weight.T
        assert torch.equal(full.greedy(hidden), logits.argmax(dim=1))

        head = FlashHead(weight, {"asset": path, "probes": 8})
        chosen = (hidden.double() @ head.centroids.double().T).topk(8, dim=1).indices
        ids = head.cluster_token_ids[chosen].reshape(16, -1)
        masked = logits.gather(1, ids.clamp_min(0)).masked_fill(ids == PAD_TOKEN, float("-inf"))
        assert torch.equal(head.greedy(hidden), ids.gather(1, masked.argmax(dim=1, keepdim=True)).squeeze(1))

        static = torch.zeros_like(hidden)
        head.greedy(static)  # compile before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = head.greedy(static)
        for _ in range(2):
            fresh = torch.randn(16, 128, device="cuda")
            static.copy_(fresh)
            graph.replay()
            assert torch.equal(captured, head.greedy(fresh))
