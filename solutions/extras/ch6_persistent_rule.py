"""Chapter 6's FA3 forward at short problems (32,768 tokens a batch, 16 heads, fp16): the
planner's pick as a reader calls it (``public``), the two-consumer 64 x 128 tiles persistent
(``persist``) and as a grid (``default_grid``), 64 x 64 tiles in four stages persistent, three
consumers persistent at d = 64 (FA3's d = 64 CTA; 64 x 128 tiles in two stages, ``persist3``, and
64 x 64 in four, ``persist3_64x64x4``), and cuDNN; each launch's O checked against SDPA
(``*_err``). The evidence for ``fa3_planner``'s persistent rule: ``h100.json`` (a run before
the three-consumer columns existed) and ``h100_three_consumers.json`` in
``src/flashbook/data/fa3_persistent_rule``.

    python solutions/extras/ch6_persistent_rule.py TAG    (TAG labels the rows and the file)

writes ``$OUT/earlyq_TAG.jsonl`` (``OUT`` default ``.``). Needs an H100/H200."""
import dataclasses, json, os, sys, torch, triton
import flashbook; flashbook.setup()
from flashbook import fa3_launch as L, fa3_planner as P
from flashbook.reference import attention_flops
tag = sys.argv[1]
print(tag, flashbook.__file__, torch.cuda.get_device_name(), flush=True)
bench = lambda f: triton.testing.do_bench(f, warmup=50, rep=200, return_mode="median")
out = open(os.environ.get("OUT", ".") + f"/earlyq_{tag}.jsonl", "w")
for d in (128, 64):
    for causal in (False, True):
        for N in (512, 1024, 2048, 4096):
            B, H = 32768 // N, 16
            q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=torch.float16) for _ in range(3))
            fl = attention_flops(B, H, N, N, d, causal)
            pick = L.pick_config(d, torch.float16, causal, B, H, N, N)
            base = dataclasses.replace(pick, CONSUMERS=2)
            if not P.feasible(base): base = P.Config(BLOCK_M=64, BLOCK_N=128, STAGES=2).for_inputs(d, "float16")
            r = dict(tag=tag, d=d, causal=causal, N=N, pick=str(pick))
            r["public"] = fl / bench(lambda: L.attention_fa3(q, k, v, causal)) / 1e9
            ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
            for name, c in (("persist", dataclasses.replace(base, PERSISTENT=True, GROUP=1)),
                            ("persist_64x64x4", P.Config(BLOCK_M=64, BLOCK_N=64, STAGES=4, PERSISTENT=True).for_inputs(d, "float16")),
                            ("persist3", P.Config(BLOCK_M=64, BLOCK_N=128, STAGES=2, CONSUMERS=3, PERSISTENT=True).for_inputs(d, "float16")),
                            ("persist3_64x64x4", P.Config(BLOCK_M=64, BLOCK_N=64, STAGES=4, CONSUMERS=3, PERSISTENT=True).for_inputs(d, "float16")),
                            ("default_grid", dataclasses.replace(base, PERSISTENT=False))):
                if not P.feasible(c): r[name] = "infeasible"; continue
                o, _ = L.attention_fa3(q, k, v, causal, config=c)
                r[name + "_err"] = (o.float() - ref.float()).abs().max().item()
                r[name] = fl / bench(lambda: L.attention_fa3(q, k, v, causal, config=c)) / 1e9
            from torch.nn.attention import sdpa_kernel, SDPBackend
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                r["cudnn"] = fl / bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)) / 1e9
            print(json.dumps({a: (round(b, 1) if isinstance(b, float) and b > 1 else b) for a, b in r.items()}), flush=True)
            out.write(json.dumps(r) + "\n"); out.flush()
            del q, k, v
