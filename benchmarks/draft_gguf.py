"""Write a shared-embedding draft model (the shipped `draft`, or a `specdec train draft` folder) as a
standalone llama-architecture GGUF, so llama.cpp can speculate with it (the bench's `llamacpp-draft`
peer, `--draft-gguf`).

The file holds the draft's decoder layers (Q8_0, quantised by gguf's reference quantiser; q and k rows
in llama.cpp's order) and final norm, and borrows the target GGUF's token embedding (its own blocks,
copied as they are), tied LM head, tokenizer and every other metadata field. One difference from
specdec's `draft_model` drafter: a GGUF LM head spans the whole vocabulary, so a draft trained with a
reduced draft vocabulary (d2t) predicts over all tokens here.

    python benchmarks/draft_gguf.py --out /tmp/draft.gguf [--draft FOLDER] [--target default]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants
from safetensors.numpy import load_file

from specdec.drafters.shipped import SHIPPED
from specdec.models.loading import resolve_gguf

LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def permute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Hugging Face q / k rows -> llama.cpp's order (each head's rotary halves interleaved)."""
    return rows.reshape(n_head, 2, rows.shape[0] // n_head // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def copy_metadata(reader: GGUFReader, writer: GGUFWriter, layers: int) -> None:
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = layers if name == "llama.block_count" else field.contents()
        sub_type = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, field.types[0], sub_type=sub_type)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", default=str(SHIPPED / "draft"), help="a draft folder (config.json + model.safetensors)")
    p.add_argument("--target", default="default", help="the target GGUF whose embedding and tokenizer the draft borrows")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    folder, target = Path(args.draft), resolve_gguf(args.target)
    if target is None:
        print(f"{args.target} is not a GGUF file", file=sys.stderr)
        return 2
    config = json.loads((folder / "config.json").read_text())
    state = load_file(str(folder / "model.safetensors"))
    reader = GGUFReader(str(target))
    if bytes(reader.fields["general.architecture"].parts[-1]).decode() != "llama":
        print("only llama-architecture targets", file=sys.stderr)
        return 2
    writer = GGUFWriter(args.out, arch="llama")
    copy_metadata(reader, writer, config["num_hidden_layers"])
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    writer.add_tensor("token_embd.weight", np.array(embed.data), raw_dtype=embed.tensor_type)
    writer.add_tensor("output_norm.weight", state["model.norm.weight"].astype(np.float32))
    heads = {"self_attn.q_proj": config["num_attention_heads"], "self_attn.k_proj": config["num_key_value_heads"]}
    for i in range(config["num_hidden_layers"]):
        for hf_name, gguf_name in LAYER_NAMES.items():
            w = state[f"model.layers.{i}.{hf_name}.weight"].astype(np.float32)
            if hf_name in heads:
                w = permute(w, heads[hf_name])
            if w.ndim == 1:
                writer.add_tensor(f"blk.{i}.{gguf_name}.weight", w)
            else:
                writer.add_tensor(f"blk.{i}.{gguf_name}.weight", quants.quantize(w, GGMLQuantizationType.Q8_0),
                                  raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"wrote {args.out}: {config['num_hidden_layers']} layers (Q8_0) of {folder}, embedding and tokenizer of {target.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
