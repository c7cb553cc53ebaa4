"""A tokenizer trained here and a tiny random causal LM, for trainer tests (nothing is downloaded).

The tokenizer is a byte-level BPE trained on the texts it will see, wrapped as a `transformers`
fast tokenizer with a small chat template (`CHAT_TEMPLATE`: ``<|role|>content<|end|>``, native
tool calls as ``<call>name args</call>``). The model is a one-layer Llama of random weights.
"""

from __future__ import annotations

from collections.abc import Iterable

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] or '' }}"
    "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}<call>{{ c['function']['name'] }} "
    "{{ c['function']['arguments'] }}</call>{% endfor %}{% endif %}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL = ["<pad>", "<eos>", "<unk>", "<|end|>", "<call>", "</call>",
           *(f"<|{r}|>" for r in ("system", "user", "assistant", "tool"))]


def tiny_tokenizer(texts: Iterable[str], vocab_size: int = 600, eos: str = "<eos>"):
    """A BPE tokenizer trained on `texts`, with `CHAT_TEMPLATE`; `eos` is its end token (pass
    ``"<|end|>"`` to end generation at the end of an assistant turn, as chat models do)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(list(texts), trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token=eos, unk_token="<unk>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_causal_lm(tok, max_positions: int = 65536, seed: int = 0):
    """A one-layer Llama with random weights over `tok`'s vocabulary."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=max_positions,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    return LlamaForCausalLM(cfg)
