"""Peer baselines measured in the same run, on the same prompts, as specdec's own methods.

- `hf`: transformers `generate`, plain (greedy or sampling), the same weights and dtype;
- `hf-pld`: transformers prompt lookup decoding (`prompt_lookup_num_tokens` = gamma);
- `hf-assisted`: transformers assisted generation with the draft model (`num_assistant_tokens` = gamma,
  constant schedule, so each gamma is what it says);
- `llamacpp` / `llamacpp-pld` / `llamacpp-draft`: llama.cpp through llama-cpp-python, when installed and
  the target is a GGUF file: plain, prompt lookup, and draft-model speculation with a draft GGUF
  (`--draft-gguf`; benchmarks/draft_gguf.py writes specdec's draft as one). llama.cpp quantises
  activations to 8 bits in its CPU products where specdec keeps float32, so its outputs need not equal
  specdec's even on the same quantised file (benchmarks/llamacpp_agreement.py measures how often they
  agree); it is a speed reference.
- `openai:URL` (`openai:URL#MODEL`; several may be given): any OpenAI-compatible server (vLLM, SGLang,
  llama-server, `specdec serve`) at URL, the server root with or without `/v1`. Each prompt's token ids go
  to POST /v1/completions (a list of ints as `prompt`, which OpenAI's API, vLLM, SGLang and specdec's
  server accept) with the bench's max_tokens and sampling, `stream: false`; the model is the first one
  GET /v1/models lists unless #MODEL names it; `OPENAI_API_KEY`, when set, goes as a Bearer key. Wall time
  is the whole request, tokens `usage.completion_tokens`. Its output token ids come from the server when it
  gives them: `return_token_ids` (vLLM >= 0.10.2: `choices[0].token_ids`), else `logprobs: 1` with
  `return_tokens_as_token_ids` (older vLLM: "token_id:N" tokens; the server then also computes a
  logprob per token). The first request probes these in that order (`specdec serve` answers the first);
  a server that gives neither (SGLang, llama-server) is compared by text: its text against specdec
  plain's decoded text, ignoring leading whitespace (detokenizers differ on the first token's space), and
  results.json says which comparison was made (`lossless_compared`). GET /metrics, read after the
  warm-up and after the last run, gives the server's own speculative-decoding counters
  (`vllm:spec_decode_*`, which vLLM and `specdec serve` expose) over the bench's requests: acceptance,
  mean accepted length (1 + accepted / drafts, vLLM's definition) and acceptance per position. Other
  traffic to the same server in that window counts too.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdec.config import SamplingParams
from specdec.errors import UserError

PEERS = ("hf", "hf-pld", "hf-assisted", "llamacpp", "llamacpp-pld", "llamacpp-draft")
OPENAI = "openai"  # the family of `openai:URL` peers


@dataclass
class PeerOutput:
    token_ids: list[int] | None  # generated tokens (EOS included when it ended the output); None: not given
    wall_s: float
    text: str | None = None  # the text a server returned (the bench decodes token_ids for the others)
    num_tokens: int | None = None  # tokens generated, as the server counted them (default: len(token_ids))


def hf_generate_kwargs(sampling: SamplingParams) -> dict:
    """`generate` settings that draw from the distribution specdec samples (temperature, then top-k, top-p
    and min-p, the order transformers applies them in). Each is passed even when off, because one left out
    falls back to the model's or transformers' default (top_k 50). transformers skips top_k 0 and top_p 1 as off,
    but applies min-p whenever it is not None, so min_p 0 goes as None."""
    if sampling.greedy:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
            "min_p": sampling.min_p or None}


def neutral_generation_config(loaded):
    """A GenerationConfig with only the special token ids of `loaded` (the model folder's
    generation_config.json). `generate` fills every setting a call leaves out from the model's own config,
    so a shipped temperature, top_p, min_p or repetition_penalty would otherwise change what the peer
    samples, and a repetition penalty would change even its greedy output."""
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=loaded.bos_token_id, eos_token_id=loaded.eos_token_id, pad_token_id=loaded.pad_token_id
    )


class HFPeer:
    """transformers `generate` on an AutoModelForCausalLM loaded from the target's own folder."""

    def __init__(self, folder: str, dtype: torch.dtype, device: torch.device, assistant_folder: str | None = None) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
        self.model.generation_config = neutral_generation_config(self.model.generation_config)
        self.device = device
        self.assistant = None
        if assistant_folder is not None:
            self.assistant = AutoModelForCausalLM.from_pretrained(assistant_folder, dtype=dtype).to(device).eval()

    @torch.inference_mode()
    def generate(self, prompt: list[int], max_new_tokens: int, sampling: SamplingParams, mode: str, gamma: int = 0) -> PeerOutput:
        ids = torch.tensor([prompt], device=self.device)
        kwargs = {"attention_mask": torch.ones_like(ids), "max_new_tokens": max_new_tokens, **hf_generate_kwargs(sampling)}
        if mode == "hf-pld":
            kwargs["prompt_lookup_num_tokens"] = gamma
        elif mode == "hf-assisted":
            if self.assistant is None:
                raise UserError("hf-assisted needs a draft model (--draft-model)")
            self.assistant.generation_config.num_assistant_tokens = gamma
            self.assistant.generation_config.num_assistant_tokens_schedule = "constant"
            kwargs["assistant_model"] = self.assistant
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        t = time.perf_counter()
        out = self.model.generate(ids, **kwargs)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return PeerOutput(token_ids=out[0, len(prompt):].tolist(), wall_s=time.perf_counter() - t)


def llama_cpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def llama_cpp_draft_model(path: Path, gamma: int, threads: int, context: int):
    """A llama-cpp-python draft model (its speculative loop's interface) that runs a draft GGUF in llama.cpp
    and proposes its `gamma` greedy tokens; it keeps its own cache across calls, re-reading only what
    differs from what it read last."""
    import numpy as np
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaDraftModel

    class DraftGGUF(LlamaDraftModel):
        def __init__(self) -> None:
            self.llm = Llama(model_path=str(path), n_ctx=context, n_threads=threads, verbose=False)

        def __call__(self, input_ids, /, **kwargs):
            llm, ids = self.llm, [int(t) for t in input_ids]
            known = llm.input_ids[: llm.n_tokens].tolist()
            same = next((i for i, (a, b) in enumerate(zip(known, ids)) if a != b), min(len(known), len(ids)))
            llm.n_tokens = min(same, len(ids) - 1)  # eval drops the cache past n_tokens; read at least one token
            llm.eval(ids[llm.n_tokens:])
            drafted = []
            for i in range(gamma):
                logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
                drafted.append(int(logits.argmax()))
                if i + 1 < gamma:
                    llm.eval(drafted[-1:])
            return np.array(drafted, dtype=np.intc)

    return DraftGGUF()


class LlamaCppPeer:
    """llama.cpp (llama-cpp-python) on the target's GGUF file; `draft`: a draft GGUF for llamacpp-draft."""

    def __init__(self, gguf: Path, threads: int, context: int, draft: Path | None = None) -> None:
        from llama_cpp import Llama

        self.gguf, self.threads, self.context, self.draft = gguf, threads, context, draft
        self.plain = Llama(model_path=str(gguf), n_ctx=context, n_threads=threads, verbose=False)
        self.speculative: dict[tuple[str, int], object] = {}

    def model_for(self, mode: str, gamma: int):
        if mode == "llamacpp":
            return self.plain
        if (mode, gamma) not in self.speculative:
            from llama_cpp import Llama
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            drafter = (LlamaPromptLookupDecoding(num_pred_tokens=gamma) if mode == "llamacpp-pld"
                       else llama_cpp_draft_model(self.draft, gamma, self.threads, self.context))
            self.speculative[mode, gamma] = Llama(model_path=str(self.gguf), n_ctx=self.context, n_threads=self.threads,
                                                  verbose=False, draft_model=drafter)
        return self.speculative[mode, gamma]

    def generate(self, prompt: list[int], max_new_tokens: int, sampling: SamplingParams, mode: str, gamma: int = 0) -> PeerOutput:
        llm = self.model_for(mode, gamma)
        llm.reset()
        t = time.perf_counter()
        tokens: list[int] = []
        params = {"temp": 0.0, "top_k": 1} if sampling.greedy else llama_cpp_sampling(sampling)
        for token in llm.generate(prompt, reset=True, **params):
            tokens.append(token)
            if token == llm.token_eos() or len(tokens) >= max_new_tokens:
                break
        return PeerOutput(token_ids=tokens, wall_s=time.perf_counter() - t)


def llama_cpp_sampling(sampling: SamplingParams) -> dict:
    """llama-cpp-python `generate` settings for a sampled run. Each is passed because its defaults are not
    off (top_k 40, top_p 0.95, min_p 0.05); llama.cpp treats top_k 0, top_p 1 and min_p 0 as off, as specdec
    does. It applies the temperature after the filters, so with top-p or min-p on the kept set can differ."""
    return {"temp": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p, "min_p": sampling.min_p}


# ---- openai:URL: an OpenAI-compatible server ------------------------------------------------------

OPENAI_TIMEOUT_S = 600.0
SPEC_DECODE_COUNTERS = {  # vLLM's names (specdec serve exposes them too) -> our keys
    "vllm:spec_decode_num_drafts_total": "drafts",
    "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "accepted_tokens",
}
SPEC_DECODE_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"  # label position="i", 0-based
SAMPLE_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?\s*$")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')
TOKEN_ID = re.compile(r"^token_id:(\d+)$")
# How the server's output token ids are read, tried in this order by the first request.
ID_SOURCES = {
    "return_token_ids": {"return_token_ids": True},
    "logprobs": {"logprobs": 1, "return_tokens_as_token_ids": True},
    "text": {},
}


def is_openai_peer(peer: str) -> bool:
    return peer.startswith(OPENAI + ":")


@dataclass(frozen=True)
class OpenAIEndpoint:
    peer: str  # as given: openai:URL[#MODEL]
    root: str  # scheme://host[:port][/path], without a trailing /v1
    model: str | None  # named after '#'
    label: str  # the method's name: openai:host:port, or openai:MODEL@host:port


def parse_openai_peer(peer: str) -> OpenAIEndpoint:
    """`openai:URL[#MODEL]`: the server root (a trailing /v1 is dropped) and the model it names, if any."""
    url, _, model = peer[len(OPENAI) + 1:].partition("#")
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"peer {peer!r}: expected openai:http://HOST:PORT (optionally /v1 and #MODEL)")
    path = parts.path.rstrip("/")
    path = path[:-3] if path.endswith("/v1") else path
    where = parts.netloc.rpartition("@")[2] + path
    model = model.strip() or None
    return OpenAIEndpoint(peer, f"{parts.scheme}://{parts.netloc}{path}", model,
                          f"{OPENAI}:{model}@{where}" if model else f"{OPENAI}:{where}")


class ServerError(UserError):
    """An HTTP error status from the server (status kept, so a probe can tell a refused field)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def error_message(body: bytes) -> str:
    """The message of an error body: OpenAI's {"error": {"message"}}, FastAPI's {"detail"}, or the text."""
    text = body.decode("utf-8", "replace")
    try:
        doc = json.loads(text)
    except ValueError:
        return one_line(text) or "(empty body)"
    if isinstance(doc, dict):
        err = doc.get("error", doc.get("detail", doc.get("message")))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err is not None:
            return one_line(err if isinstance(err, str) else json.dumps(err))
    return one_line(text)


@dataclass
class SpecDecodeCounters:
    """vLLM's speculative-decoding counters as one server reports them at one moment."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0
    accepted_per_position: list[float] = field(default_factory=list)  # index = 0-based draft position


def parse_labels(text: str) -> dict[str, str]:
    return {k: v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\") for k, v in LABEL.findall(text or "")}


def parse_spec_decode_metrics(text: str, model: str | None = None) -> SpecDecodeCounters | None:
    """The `vllm:spec_decode_*` counters in Prometheus text, summed over label sets (vLLM's `engine`, ...),
    or None when the text has none. With `model`, only series whose model_name label is that model count,
    if any series names it."""
    samples: list[tuple[str, dict[str, str], float]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = SAMPLE_LINE.match(line)
        if match is None:
            continue
        name, labels, value = match.groups()
        if name not in SPEC_DECODE_COUNTERS and name != SPEC_DECODE_PER_POSITION:
            continue
        try:
            samples.append((name, parse_labels(labels), float(value)))
        except ValueError:
            continue
    if not any(name in SPEC_DECODE_COUNTERS for name, _, _ in samples):
        return None
    if model is not None and any(labels.get("model_name") == model for _, labels, _ in samples):
        samples = [s for s in samples if s[1].get("model_name", model) == model]
    out = SpecDecodeCounters()
    for name, labels, value in samples:
        if name in SPEC_DECODE_COUNTERS:
            key = SPEC_DECODE_COUNTERS[name]
            setattr(out, key, getattr(out, key) + value)
        elif labels.get("position", "").isdigit():
            i = int(labels["position"])
            out.accepted_per_position += [0.0] * (i + 1 - len(out.accepted_per_position))
            out.accepted_per_position[i] += value
    return out


def spec_decode_delta(before: SpecDecodeCounters | None, after: SpecDecodeCounters | None) -> dict | None:
    """The server's own figures over a window, from its counters at both ends (None without counters at the
    end; counters missing at the start count from 0): acceptance = accepted / draft tokens, mean accepted
    length = 1 + accepted / drafts (vLLM's definition: tokens a drafting step emits), acceptance per
    position = accepted at the position / drafts."""
    if after is None:
        return None
    before = before or SpecDecodeCounters()
    drafts = after.drafts - before.drafts
    drafted = after.draft_tokens - before.draft_tokens
    accepted = after.accepted_tokens - before.accepted_tokens
    start = before.accepted_per_position + [0.0] * len(after.accepted_per_position)
    per_position = [a - b for a, b in zip(after.accepted_per_position, start)]
    out = {"source": "server /metrics: vllm:spec_decode_* counters, after the warm-up to after the last run",
           "drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
           "accepted_per_position": per_position,
           "acceptance_rate": accepted / drafted if drafted > 0 else None,
           "mean_accepted_length": 1 + accepted / drafts if drafts > 0 else None,
           "acceptance_per_position": [a / drafts for a in per_position] if drafts > 0 else []}
    if min([drafts, drafted, accepted, *per_position]) < 0:
        out.update(acceptance_rate=None, mean_accepted_length=None, acceptance_per_position=[],
                   note="the counters went down (server restarted during the bench?)")
    return out


def openai_sampling(sampling: SamplingParams) -> dict:
    """Completion fields for the bench's sampling. temperature 0 is greedy on every server named above;
    repetition_penalty 1 (a vLLM / SGLang extension, ignored elsewhere) keeps a model's shipped penalty off.
    top_k and min_p (extensions) go only when on; off, the server's default applies (vLLM: the model's
    generation_config)."""
    out: dict = {"temperature": 0.0, "repetition_penalty": 1.0}
    if sampling.greedy:
        return out
    out.update(temperature=sampling.temperature, top_p=sampling.top_p)
    if sampling.top_k:
        out["top_k"] = sampling.top_k
    if sampling.min_p:
        out["min_p"] = sampling.min_p
    if sampling.seed is not None:
        out["seed"] = sampling.seed
    return out


def token_ids_of(choice: dict, source: str) -> list[int] | None:
    """The output token ids in a completion choice, read the `source` way; None when not there."""
    if source == "return_token_ids":
        ids = choice.get("token_ids")
        return ids if isinstance(ids, list) and all(type(t) is int for t in ids) else None
    if source == "logprobs":
        tokens = (choice.get("logprobs") or {}).get("tokens") if isinstance(choice.get("logprobs"), dict) else None
        if not isinstance(tokens, list):
            return None
        matches = [TOKEN_ID.match(t) if isinstance(t, str) else None for t in tokens]
        return [int(m.group(1)) for m in matches] if all(matches) else None
    return None


class OpenAIPeer:
    """An OpenAI-compatible server, over HTTP with the standard library (see the module docstring)."""

    def __init__(self, peer: str, timeout: float = OPENAI_TIMEOUT_S, api_key: str | None = None) -> None:
        self.endpoint = parse_openai_peer(peer)
        self.timeout = timeout
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY") or None
        self.source: str | None = None  # how output token ids are read (ID_SOURCES), decided by the first request
        listed = self.list_models()
        if self.endpoint.model is None:
            if not listed:
                raise UserError(f"{self.label}: GET {self.url('/v1/models')} lists no model; name one as {peer}#MODEL")
            self.model = listed[0]
        else:
            self.model = self.endpoint.model
            if listed and self.model not in listed:
                raise UserError(f"{self.label}: the server does not serve model {self.model!r}; it lists "
                                f"{', '.join(repr(m) for m in listed[:8])}")

    @property
    def label(self) -> str:
        return self.endpoint.label

    def url(self, path: str) -> str:
        return self.endpoint.root + path

    def request(self, path: str, body: dict | None = None, timeout: float | None = None) -> bytes:
        """The response body of GET (no body) or POST (a JSON body); one-line UserErrors for what goes wrong."""
        url = self.url(path)
        headers = {"Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(url, data=data, headers=headers, method="GET" if body is None else "POST")
        what = f"{req.get_method()} {url}"
        timeout = self.timeout if timeout is None else timeout
        try:
            with urllib.request.urlopen(req, timeout=timeout) as response:
                return response.read()
        except urllib.error.HTTPError as e:
            hint = " (set OPENAI_API_KEY)" if e.code == 401 and not self.api_key else ""
            raise ServerError(f"{self.label}: {what} answered {e.code}: {error_message(e.read())}{hint}", e.code) from None
        except urllib.error.URLError as e:
            reason = e.reason if not isinstance(e.reason, TimeoutError) else f"no answer within {timeout:g} s"
            raise UserError(f"{self.label}: cannot reach {url}: {one_line(reason)}") from None
        except TimeoutError:
            raise UserError(f"{self.label}: {what}: no answer within {timeout:g} s") from None
        except OSError as e:  # a connection reset or closed mid-answer
            raise UserError(f"{self.label}: {what} failed: {one_line(e) or type(e).__name__}") from None

    def request_json(self, path: str, body: dict | None = None) -> dict:
        raw = self.request(path, body)
        try:
            doc = json.loads(raw)
        except ValueError:
            raise UserError(f"{self.label}: {self.url(path)} did not answer JSON (is it an OpenAI-compatible "
                            f"server?): {one_line(raw.decode('utf-8', 'replace'), 80)!r}") from None
        if not isinstance(doc, dict):
            raise UserError(f"{self.label}: {self.url(path)} answered JSON that is not an object")
        return doc

    def list_models(self) -> list[str]:
        """The model ids GET /v1/models lists ([] when the server has no such endpoint but a model is named)."""
        try:
            doc = self.request_json("/v1/models")
        except ServerError as e:
            if e.status == 404 and self.endpoint.model is not None:
                return []
            raise
        data = doc.get("data")
        if not isinstance(data, list):
            raise UserError(f"{self.label}: GET {self.url('/v1/models')} answered without a `data` list of models")
        return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]

    def complete(self, prompt: list[int], max_new_tokens: int, sampling: SamplingParams, source: str) -> tuple[dict, float]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_new_tokens, "stream": False,
                **openai_sampling(sampling), **ID_SOURCES[source]}
        start = time.perf_counter()
        reply = self.request_json("/v1/completions", body)
        wall = time.perf_counter() - start
        choices = reply.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict) \
                or not isinstance(choices[0].get("text"), str):
            raise UserError(f"{self.label}: POST {self.url('/v1/completions')} answered without choices[0].text")
        return reply, wall

    def probe(self, prompt: list[int], sampling: SamplingParams) -> str:
        """How this server gives output token ids: the first of ID_SOURCES it accepts and answers with ids
        (a short request each); 'text' when none does."""
        for source in ID_SOURCES:
            if source == "text":
                return source
            try:
                reply, _ = self.complete(prompt, 2, sampling, source)
            except ServerError as e:
                if e.status in (400, 422):  # the field refused (or a bad request, which the text request repeats)
                    continue
                raise
            if token_ids_of(reply["choices"][0], source) is not None:
                return source
        return "text"

    def generate(self, prompt: list[int], max_new_tokens: int, sampling: SamplingParams) -> PeerOutput:
        if self.source is None:
            self.source = self.probe(prompt, sampling)
        reply, wall = self.complete(prompt, max_new_tokens, sampling, self.source)
        choice = reply["choices"][0]
        ids = token_ids_of(choice, self.source)
        usage = reply.get("usage") if isinstance(reply.get("usage"), dict) else {}
        count = usage.get("completion_tokens")
        if type(count) is not int:
            if ids is None:
                raise UserError(f"{self.label}: POST {self.url('/v1/completions')} answered without "
                                "usage.completion_tokens")
            count = len(ids)
        return PeerOutput(token_ids=ids, wall_s=wall, text=choice["text"], num_tokens=count)

    def spec_decode_counters(self) -> SpecDecodeCounters | None:
        """The server's vLLM spec-decode counters now (None: no /metrics, or none of them in it)."""
        try:
            text = self.request("/metrics", timeout=min(self.timeout, 30.0)).decode("utf-8", "replace")
        except UserError:
            return None
        return parse_spec_decode_metrics(text, self.model)
