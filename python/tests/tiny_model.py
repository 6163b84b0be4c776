"""Tiny random-weight causal LMs that real ``vllm serve`` engines load offline, for the tests and
the demo (no hub: the weights come from a fixed seed, the tokenizer is trained here).

    python python/tests/tiny_model.py OUT_DIR [--shape llama|llama8|mla] [--seed 0]

Shapes (2 layers each; vLLM's CPU backend serves all three):

``llama``  LlamaForCausalLM, hidden 128, 4 heads / 2 KV heads, head_dim 32
``llama8`` LlamaForCausalLM, hidden 256, 8 heads / 4 KV heads, head_dim 32 (another head count
           and block payload), 8,192 positions (the others: 1,024)
``mla``    DeepseekV2ForCausalLM with MLA (one latent KV "head" replicated over TP ranks).
           vLLM's CPU MLA kernel takes only a 576-wide latent (kv_lora_rank 512 + rope 64):
           smaller ones start, then fail the first request ("Head dimension 48 is not supported
           by MLA"), so those two sizes stay real and the rest is tiny.

The tokenizer is a WordLevel model over exactly ``vocab`` words (specials ``<unk> <s> </s> <pad>``
are ids 0..3) with a chat template, saved so that ``AutoTokenizer.from_pretrained`` works with
``HF_HUB_OFFLINE=1``. Making one takes a few seconds; the same seed gives the same model.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

SHAPES = ("llama", "llama8", "mla", "deep")
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<s>' + m['role'] + ': ' + m['content'] + ' </s> ' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<s>assistant: ' }}{% endif %}"
)
_COMMON_WORDS = "the of and to in is it that for on with as was at by an be this are from".split()


def _corpus(seed: int, vocab_size: int):
    """Sentences over exactly vocab_size - len(SPECIALS) distinct words, each seen at least once."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    wanted = vocab_size - len(SPECIALS) - len(_COMMON_WORDS) - 1  # and "."
    words: set[str] = set()
    while len(words) < wanted:
        word = "".join(rng.choice(letters) for _ in range(rng.randint(3, 7)))
        if word not in _COMMON_WORDS:
            words.add(word)
    vocab = _COMMON_WORDS + sorted(words)
    yield " ".join(vocab) + " ."
    for _ in range(4000):
        yield " ".join(rng.choice(vocab) for _ in range(rng.randint(5, 30))) + " ."


def _tokenizer(out: Path, vocab_size: int, seed: int):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                        min_frequency=1)
    tok.train_from_iterator(_corpus(seed, vocab_size), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>", model_max_length=1024)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return fast


def _config(shape: str, vocab: int, tok) -> dict:
    common = dict(vocab_size=vocab, max_position_embeddings=1024, num_hidden_layers=2,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                  initializer_range=0.02)
    if shape in ("llama", "llama8"):
        hidden, heads, kv_heads = {"llama": (128, 4, 2), "llama8": (256, 8, 4)}[shape]
        return dict(common, model_type="llama", architectures=["LlamaForCausalLM"],
                    hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=heads,
                    num_key_value_heads=kv_heads, head_dim=hidden // heads, rope_theta=10000.0,
                    hidden_act="silu",
                    # llama8 takes requests of thousands of tokens (test_vllm_serve.py's fillers);
                    # RoPE without scaling: the same outputs below 1,024 tokens.
                    max_position_embeddings=8192 if shape == "llama8" else 1024)
    if shape == "deep":
        # Many layers and a wide KV over little compute (128 KiB of KV a token in 32 layers):
        # what layer writes overlap with the prefill is a share of the layers, and the benchmark
        # (python/bench/bench_layer_writes.py) wants the transfer to weigh against a CPU's prefill.
        return dict(common, model_type="llama", architectures=["LlamaForCausalLM"],
                    num_hidden_layers=32, hidden_size=64, intermediate_size=128,
                    num_attention_heads=4, num_key_value_heads=4, head_dim=128,
                    rope_theta=10000.0, hidden_act="silu", max_position_embeddings=4096)
    if shape == "mla":
        return dict(common, model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"],
                    hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
                    kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
                    n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                    first_k_dense_replace=2, moe_layer_freq=1, topk_method="greedy", n_group=1,
                    topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False,
                    scoring_func="softmax", aux_loss_alpha=0.0, seq_aux=False,
                    rope_theta=10000.0, rope_scaling=None, attention_bias=False,
                    hidden_act="silu")
    raise ValueError(f"unknown shape {shape!r}; one of {', '.join(SHAPES)}")


def make_model(out: Path | str, shape: str = "llama", seed: int = 0, vocab: int = 1024) -> Path:
    """Writes the model into ``out`` (created) and returns it; does nothing if it is there."""
    out = Path(out)
    done = out / ".kvferry-tiny-model"
    if done.exists() and done.read_text() == f"{shape} {seed} {vocab}":
        return out
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(out, vocab, seed)
    config_path = out / "config.json"
    config_path.write_text(json.dumps(_config(shape, vocab, tok), indent=2))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(out)),
                                             dtype=torch.float32)
    model.eval()
    model.save_pretrained(str(out), safe_serialization=True)
    saved = json.loads(config_path.read_text())  # save_pretrained rewrites it
    saved["torch_dtype"] = saved["dtype"] = "float32"
    config_path.write_text(json.dumps(saved, indent=2))
    done.write_text(f"{shape} {seed} {vocab}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--shape", default="llama", choices=SHAPES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab", type=int, default=1024)
    args = parser.parse_args()
    print(make_model(args.out, args.shape, args.seed, args.vocab))


if __name__ == "__main__":
    main()
