"""An output's text with a WordPiece tokenizer (BERT style, as some generative models ship it) whose
tokenizer_config.json asks for transformers' clean-up of spaces: that clean-up takes back a space already streamed
("it '" then "s" reads "it's"), so the engine decodes without it, as vLLM does; streamed or not, the text is the
same."""

import json

import pytest

from waferline import LLM, SamplingParams
from waferline.engine.scheduler import Scheduler, SchedulerConfig
from waferline.engine.sequence import Sequence


@pytest.fixture(scope="module")
def wp_llm(tmp_path_factory, one_thread):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tiny_models import build

    d = tmp_path_factory.mktemp("wp")
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "hello", "it", "'", "s", "o", "##k", "?"])}
    tk = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tk.normalizer = normalizers.BertNormalizer(lowercase=True)
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.decoder = decoders.WordPiece()
    hf = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", sep_token="[SEP]", cls_token="[CLS]",
                                 pad_token="[PAD]", eos_token="[SEP]")
    build("llama", d, vocab_size=len(hf))
    hf.save_pretrained(d)
    config = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps(config | {"clean_up_tokenization_spaces": True}))
    return LLM(d)


def test_streamed_text_adds_up_to_the_outputs_text(wp_llm):
    """The output "it's ok?" as tokens it ' s o ##k ?: the stream sent " '" and " s" before the whole decode's
    clean-up joined them to "'s", and an output that max_tokens ended lost its last token's "?" (the text sent was
    longer than the cleaned-up text its last piece was cut from)."""
    llm = wp_llm
    assert llm.tokenizer.decode(llm.encode("it's ok?")) == "it's ok?"  # (the clean-up is on)
    prompt, out = llm.encode("hello"), llm.tokenizer.encode("it's ok?", add_special_tokens=False)
    eos = llm.tokenizer.convert_tokens_to_ids("[SEP]")
    for toks, params in ((out, SamplingParams(max_tokens=len(out))),
                         (out + [eos], SamplingParams(max_tokens=9, stop_token_ids=[eos]))):
        sch = Scheduler(llm, SchedulerConfig(max_num_seqs=1))
        events: list = []
        seq = Sequence("s", list(prompt), params, events.append)
        for tok in toks:
            sch._sample(seq, None, tok)
        assert seq.status == "finished"
        text = llm.make_output(prompt, toks, seq.finish_reason, {eos}, params, {}).text
        assert "".join(e.text for e in events) == text == " it ' s ok?", params
