"""A drafter's cost on the GPU over fresh prompts (each prompt new to the kernels' plan caches):
tokens/s, steps and the time split between drafting and verifying (default model, bf16)."""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import specdec  # noqa: E402
from specdec.api import encode_prompt  # noqa: E402
from specdec.bench.tasks import load_tasks  # noqa: E402

model = specdec.load_model("default", dtype="bfloat16", device="cuda")
prompts = [encode_prompt(model.tokenizer, t.prompt) for t in load_tasks("gsm8k-eval", 4)]
for drafter in sys.argv[1:]:
    engine = specdec.SpecEngine(model, drafter)
    config = specdec.SpecConfig(gamma=4, max_new_tokens=128)
    engine.generate(prompts[:1], config)
    for prompt in prompts[1:]:
        t = time.perf_counter()
        s = engine.generate([prompt], config).stats
        wall = time.perf_counter() - t
        print(f"{drafter}: {s.emitted / wall:.0f} tok/s, steps {s.steps}, draft {s.draft_s:.3f} s, verify {s.target_s:.3f} s", flush=True)
