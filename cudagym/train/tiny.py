"""A tokenizer trained here and a small random causal LM: a trainer's set-up checked end to end
without downloading a model (the trainer tests; `benchmarks/train_grpo_gpu.py`).

The tokenizer is a byte-level BPE trained on the texts it will see, wrapped as a `transformers`
fast tokenizer with a small chat template (`CHAT_TEMPLATE`: ``<|role|>content<|end|>``, native
tool calls as ``<call>name args</call>``). The model is a Llama of random weights (one layer,
width 32 by default). Neither has learned anything: a run with them proves the loop, not learning.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] or '' }}"
    "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}<call>{{ c['function']['name'] }} "
    "{{ c['function']['arguments'] }}</call>{% endfor %}{% endif %}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL = ["<pad>", "<eos>", "<unk>", "<|end|>", "<call>", "</call>",
           *(f"<|{r}|>" for r in ("system", "user", "assistant", "tool"))]


def tiny_tokenizer(texts: Iterable[str], vocab_size: int = 600, eos: str = "<eos>") -> PreTrainedTokenizerFast:
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


def tiny_causal_lm(tok: PreTrainedTokenizerFast, max_positions: int = 65536, seed: int = 0, layers: int = 1,
                   hidden: int = 32) -> LlamaForCausalLM:
    """A Llama of `layers` layers and width `hidden` with random weights over `tok`'s vocabulary."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=max_positions,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    return LlamaForCausalLM(cfg)


def kernel_texts(task_ids: Iterable[str], target: str = "cpu", mode: str = "strict") -> list[str]:
    """Texts a tokenizer for KernelEnv episodes is trained on: the system prompt, each task's
    prompt and stored solution (`ScriptedPolicy`), a tool call and a tool response."""
    from cudagym.agent.prompt import system_prompt, tool_response
    from cudagym.agent.scripted import ScriptedPolicy
    from cudagym.env.prompt import task_prompt
    from cudagym.env.tools import Toolbox
    from cudagym.tasks.loaders import bundled_task
    from cudagym.tasks.model import Target

    texts = [system_prompt(target, mode, Toolbox().schemas(), hermes=True),
             '<tool_call>\n{"name": "write_file", "arguments": {"path": "model_new.py"}}\n</tool_call>',
             tool_response("[compile] Compile succeeded\n[verify] Verify PASSED")]
    for task_id in task_ids:
        texts.append(task_prompt(bundled_task(task_id).for_target(Target(target)), Target(target)))
        texts += ScriptedPolicy().solution_files(task_id, target).values()
    return texts
