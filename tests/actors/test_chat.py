"""Chat templates render a conversation as transformers' `apply_chat_template` does,
token for token, for a Llama-3-style and a Qwen-style template on tiny random models
saved with `save_pretrained`; `LLM.chat` uses the demo model's own template."""

from __future__ import annotations

import json

import pytest

from cadence.actors.chat import ChatTemplate, ChatTemplateError, encode_rendered
from cadence.actors.cli import demo_model_dir
from cadence.actors.llm import LLM
from cadence.gpu.tokenizer import Tokenizer
from cadence.statemachine.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

# Written for this test in the manner of Llama 3's template: header tokens per
# turn, a default system prompt, raise_exception on an unknown role.
LLAMA3_STYLE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = 'You are helpful.' %}{% endif %}"
    "<|start_header_id|>system<|end_header_id|>\n\n{{ system | trim }}<|eot_id|>"
    "{% for message in messages %}"
    "{% if message['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

# Written for this test in the manner of Qwen's ChatML template: tools listed
# with tojson, im_start / im_end turns, block tags trimmed by trim_blocks.
QWEN_STYLE = """{% if tools %}
<|im_start|>system
{{ messages[0]['content'] if messages[0]['role'] == 'system' else 'You are a helper.' }}

# Tools
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
<|im_end|>
{% elif messages[0]['role'] == 'system' %}
<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{% for message in messages %}
{% if message['role'] != 'system' %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eot_id|>"]
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["You are helpful. What is the capital of France? Paris is the capital.",
          "def add(a, b): return a + b  # tools and <json> & \"quotes\"",
          "The weather in Zürich is sunny; naïve café."] * 4

CONVERSATION = [
    {"role": "system", "content": "Answer in one line. <b>bold</b> & \"quoted\""},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Zürich's canton?"},
]
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather <now> & later",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}}}}]


# Per style: its special tokens, the tokenizer's named tokens, the model class, the template.
STYLES = {
    "llama": (LLAMA_SPECIALS, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
              "LlamaConfig", "LlamaForCausalLM", LLAMA3_STYLE),
    "qwen": (QWEN_SPECIALS, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
             "Qwen2Config", "Qwen2ForCausalLM", QWEN_STYLE),
}


def _save_model(tmp_path, kind: str):
    """A tiny random model and a small byte-level BPE tokenizer, saved as a model folder."""
    specials, named_tokens, config_class, model_class, template = STYLES[kind]
    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS, trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **named_tokens)
    tokenizer.chat_template = template
    config = getattr(transformers, config_class)(
        vocab_size=backend.get_vocab_size(), hidden_size=16, intermediate_size=32,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    path = tmp_path / kind
    getattr(transformers, model_class)(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _move_template_into_tokenizer_config(path) -> None:
    """The older layout: the template as tokenizer_config.json's chat_template."""
    template_file = path / "chat_template.jinja"
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if template_file.is_file():
        config["chat_template"] = template_file.read_text()
        template_file.unlink()
    config_path.write_text(json.dumps(config))


@pytest.mark.parametrize("kind", ["llama", "qwen"])
@pytest.mark.parametrize("layout", ["jinja_file", "tokenizer_config"])
def test_a_template_renders_and_tokenizes_as_transformers_does(tmp_path, kind, layout):
    path = _save_model(tmp_path, kind)
    if layout == "tokenizer_config":
        _move_template_into_tokenizer_config(path)
    reference = transformers.AutoTokenizer.from_pretrained(path)
    template = ChatTemplate.from_dir(path)
    ours = Tokenizer.from_pretrained(path)
    cases = [(CONVERSATION, True, None), (CONVERSATION[1:], False, None), (CONVERSATION, True, TOOLS)]
    for messages, add_generation_prompt, tools in cases:
        text = template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        expected_text = reference.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False)
        assert text == expected_text
        expected_ids = reference.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True,
            return_dict=False)
        assert encode_rendered(ours, text) == list(expected_ids)
    # Special tokens are one id each, not spelled out in pieces.
    first = encode_rendered(ours, template.render(CONVERSATION))[0]
    assert ours.id_to_token(first) == ("<|begin_of_text|>" if kind == "llama" else "<|im_start|>")


def test_a_template_refusal_is_a_chat_template_error(tmp_path):
    template = ChatTemplate.from_dir(_save_model(tmp_path, "llama"))
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        template.render([{"role": "tool", "content": "42"}])


def test_the_sandbox_refuses_reaching_python_internals():
    template = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        template.render([{"role": "user", "content": "x"}])


def test_a_conversation_the_template_cannot_render_is_a_chat_template_error():
    """What fails inside the template on a request's own values (a number where it
    iterates tool calls) is that request's error, not an engine fault."""
    template = ChatTemplate("{% for m in messages %}{% for call in m.tool_calls %}x{% endfor %}{% endfor %}")
    with pytest.raises(ChatTemplateError, match="could not render the conversation: TypeError"):
        template.render([{"role": "assistant", "content": None, "tool_calls": 1}])
    assert template.render([{"role": "assistant", "content": None, "tool_calls": [{}, {}]}]) == "xx"


def test_a_malformed_conversation_names_the_message():
    template = ChatTemplate("{{ messages | length }}")
    with pytest.raises(ValueError, match=r"messages\[1\].role"):
        template.render([{"role": "user", "content": "x"}, {"content": "no role"}])


def test_the_demo_model_chats_out_of_the_box():
    demo = demo_model_dir()
    template = ChatTemplate.from_dir(demo)
    messages = [{"role": "user", "content": "write a function"}]
    expected = encode_rendered(Tokenizer.from_pretrained(demo), template.render(messages))
    with LLM(executor="inprocess", model=demo, max_model_len=256, num_blocks=64) as llm:
        [result] = llm.chat(messages, SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        [plain] = llm.generate(expected, SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert result.prompt_token_ids == expected
    assert result.prompt_token_ids[0] == 256  # <bos>, written by the template
    assert result.token_ids == plain.token_ids and len(result.token_ids) == 4


@pytest.mark.parametrize(("part", "complaint"), [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
     r"messages\[1\].content\[1\].type is 'image_url': this model reads text only"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
     r"messages\[1\].content\[1\].type is 'input_audio'"),
    ({"text": "no type"}, r"messages\[1\].content\[1\].type is None"),
    ("a bare string", r"messages\[1\].content\[1\] must be an object, got str"),
    ({"type": "text", "text": 7}, r"messages\[1\].content\[1\].text must be a string"),
])
def test_a_part_the_model_cannot_read_is_refused_not_dropped(part, complaint):
    """The demo template joins the parts' `text`: an image part would vanish from the
    prompt without a word, so the model would answer a question about a picture it
    never saw. Such a part is refused, naming it; text parts render as before."""
    template = ChatTemplate.from_dir(demo_model_dir())
    first = {"role": "system", "content": "be brief"}
    text = {"type": "text", "text": "what is this"}
    with pytest.raises(ValueError, match=complaint):
        template.render([first, {"role": "user", "content": [text, part]}])
    both = template.render([first, {"role": "user", "content": [text, {"type": "input_text", "text": "?"}]}])
    assert "what is this?" in both
