"""A "scripted" tiny Llama: whatever the conversation, greedy decoding emits a fixed sequence of text pieces, so
server tests can see exact reasoning markers and tool calls come out of a real engine.

How: the tokenizer is byte-level (any prompt text encodes) with every script piece added as one token. The
model's attention and MLP output projections are almost zero, so the last hidden state is (nearly) the current
token's embedding; the chain's tokens (the trigger, i.e. the ``"\\n"`` that ends every generation prompt, then the
pieces) have orthogonal one-hot embeddings, and the LM head maps each chain token to the next one (the last piece
to EOS). Every chain token is distinct, so the chain cannot loop. Other tokens embed into the remaining, unread
dimensions. `check_with_transformers` confirms the script with HF transformers' greedy generate.

The chat template is Qwen / hermes style, written here: a system block listing the tools when given, assistant
``tool_calls`` as ``<tool_call>`` blocks (arguments as JSON), ``tool`` messages as ``<tool_response>`` blocks in a
user turn, and a generation prompt that can open a think block (DeepSeek-R1 style) or, with
``enable_thinking=False``, write an empty one (Qwen3 style).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

IM_START, IM_END, PAD = "<|im_start|>", "<|im_end|>", "<|endoftext|>"

_TEMPLATE = r"""{%- set ns = namespace(first=0) -%}
{%- if tools -%}
{{- '<|im_start|>system\n' -}}
{%- if messages[0].role == 'system' -%}{{- messages[0].content + '\n\n' -}}{%- set ns.first = 1 -%}{%- endif -%}
{{- 'You can call these tools, one JSON signature per line:\n<tools>\n' -}}
{%- for tool in tools -%}{{- (tool | tojson) + '\n' -}}{%- endfor -%}
{{- '</tools>\nCall one as <tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call><|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages[ns.first:] -%}
{%- if message.role == 'assistant' -%}
{{- '<|im_start|>assistant\n' + (message.content or '') -}}
{%- for call in (message.tool_calls or []) -%}
{%- set fn = call.function -%}
{{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' -}}
{%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}
{{- '}\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- elif message.role == 'tool' -%}
{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' -}}
{%- else -%}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}
{%- elif OPEN_THINK -%}{{- '<think>\n' -}}{%- endif -%}
{%- endif -%}"""


@dataclass(frozen=True)
class ScriptedModel:
    path: Path
    pieces: tuple[str, ...]
    token_ids: tuple[int, ...]  # the pieces' ids, then EOS
    eos_token_id: int

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def scripted_tokenizer(pieces: list[str], open_think: bool):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in (IM_START, IM_END, PAD)])
    # not special (like Qwen's <think>, <tool_call>): they survive skip_special_tokens
    tok.add_tokens([AddedToken(p, special=False, normalized=False) for p in pieces])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=PAD)
    fast.chat_template = _TEMPLATE.replace("OPEN_THINK", "true" if open_think else "false")
    return fast


def write_scripted_llama(path: Path, pieces: list[str], *, open_think: bool = False, hidden: int = 128,
                         seed: int = 0) -> ScriptedModel:
    """Save to ``path`` a Llama (HF format) + tokenizer whose greedy output after any chat prompt is ``pieces``
    then EOS. ``open_think``: the template's generation prompt opens a think block (DeepSeek-R1 style)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if len(set(pieces)) != len(pieces) or "\n" in pieces:
        raise ValueError("script pieces must be distinct and none may be the trigger '\\n'")
    tok = scripted_tokenizer(pieces, open_think)
    ids = [tok.convert_tokens_to_ids(p) for p in pieces]
    trigger = tok.encode("\n", add_special_tokens=False)
    assert len(trigger) == 1 and len(set(ids)) == len(ids)
    eos = tok.convert_tokens_to_ids(IM_END)
    chain = trigger + ids + [eos]
    used = len(chain) - 1  # one-hot dimensions the chain reads
    if used * 2 > hidden:
        raise ValueError(f"script of {len(pieces)} pieces needs hidden >= {2 * used}")
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=None,
                         eos_token_id=eos, pad_token_id=tok.pad_token_id, architectures=["LlamaForCausalLM"])
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.copy_(1e-3 * torch.randn_like(p))  # the residual stream stays the token's embedding
            else:
                p.copy_(0.05 * torch.randn_like(p))
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb[:, :used] = 0.0
        emb[:, used:] = torch.randn(emb.shape[0], hidden - used)
        for k, t in enumerate(chain[:-1]):
            emb[t] = 0.0
            emb[t, k] = 1.0
        head.zero_()
        for k in range(used):
            head[chain[k + 1], k] = 1.0  # logit sqrt(hidden) for the next chain token, ~0 for all others
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "pad_token_id": tok.pad_token_id}))
    return ScriptedModel(path, tuple(pieces), tuple(ids + [eos]), eos)


def check_with_transformers(model: ScriptedModel, messages: list[dict], tools: list[dict] | None = None,
                            **template_kwargs) -> list[int]:
    """HF transformers' greedy generation on the saved directory (an independent reference): the generated ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model.path)
    hf = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32).eval()
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                   **template_kwargs)
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=len(model.token_ids) + 4, do_sample=False,
                          eos_token_id=model.eos_token_id, pad_token_id=tok.pad_token_id)
    return out[0, ids.shape[1]:].tolist()


# -- the scripts the tests use --------------------------------------------------------------------------------
#: A thinking model: <think> written by the model (Qwen3 style). "</th" + "ink>": the closing marker arrives in two
#: tokens, so a stream must hold "</th" back.
THINK_PIECES = ["<think>", "The user asks", " for 2+2.", "</th", "ink>", "The answer", " is 4."]
#: The DeepSeek-R1 style: the prompt opened the block, the output only closes it.
R1_PIECES = ["Two plus two", " makes four.", "</think>", "It is", " 4."]
#: Reasoning, a sentence, then two hermes tool calls; the first call's end and the second's start share a token.
TOOL_PIECES = ["<think>", "I need", " the weather.", "</think>", "Let me", " check.", "<tool_call>",
               '\n{"name": "get_weather", ', '"arguments": {"city": ', '"Paris", "unit": "celsius"}}\n',
               "</tool_call>\n<tool_call>", '\n{"name": "get_time", "arguments": ', '{"timezone": "Europe/Paris"}}',
               "\n</tool", "_call>"]
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Current time in a timezone",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}},
]
