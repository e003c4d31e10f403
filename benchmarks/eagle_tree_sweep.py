"""CPU: EAGLE tokens/s against the tree node budget (3 gsm8k-eval prompts, 128 tokens), beside plain.

    python benchmarks/eagle_tree_sweep.py   (2-core CPU: 10 nodes was best, 1.69x plain; 15 gave 1.52x)
"""
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import specdec  # noqa: E402
from specdec.api import encode_prompt  # noqa: E402
from specdec.bench.tasks import load_tasks  # noqa: E402
from specdec.drafters import DrafterOptions  # noqa: E402

m = specdec.load_model("default")
prompts = [encode_prompt(m.tokenizer, t.prompt) for t in load_tasks("gsm8k-eval", 3)]
cfg = specdec.SpecConfig(gamma=5, max_new_tokens=128)
engines = {"plain": specdec.SpecEngine(m, "none")}
for n in (4, 6, 8, 10, 15):
    engines[f"eagle-{n}"] = specdec.SpecEngine(m, "eagle", DrafterOptions(extra={"total_tokens": n}))
for e in engines.values():
    e.generate(prompts[:1], specdec.SpecConfig(gamma=5, max_new_tokens=16))
rates = {k: [] for k in engines}; taus = {k: [] for k in engines}
for p in prompts:
    for k, e in engines.items():
        out = e.generate([p], cfg)
        rates[k].append(out.stats.tokens_per_s); taus[k].append(out.stats.mean_accepted_length)
for k in engines:
    print(k, "tok/s", round(statistics.median(rates[k]), 1), "tau", round(statistics.median(taus[k]), 2),
          "x plain", round(statistics.median(a / b for a, b in zip(rates[k], rates["plain"])), 2), flush=True)
