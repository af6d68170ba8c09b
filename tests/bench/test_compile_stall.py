"""bench.compile_stall's grammars: the long one is GBNF at the bound on a constraint's text (the
worker would refuse a longer one before reading it), and the small one compiles."""

import json

from bench.compile_stall import SMALL, gbnf_chain
from inference_service.engine.grammars import Grammars
from inference_service.sampling import MAX_STRUCTURED_CHARS, Structured


def test_the_long_grammar_is_a_gbnf_chain_within_the_bound():
    grammar = gbnf_chain("end 3")
    assert MAX_STRUCTURED_CHARS - 100 < len(grammar) <= MAX_STRUCTURED_CHARS
    assert grammar.startswith('root::=aaa\naaa::="a"aab\n') and grammar.endswith('::="end 3"')
    Structured("grammar", grammar)


def test_the_small_grammar_compiles(tiny_chat_model):
    vocab = json.loads((tiny_chat_model / "config.json").read_text())["vocab_size"]
    grammars = Grammars(tiny_chat_model / "tokenizer.json", vocab, (0,), timeout_s=60)
    matcher = grammars.matcher(Structured("grammar", SMALL.replace("{end}", "end 0")))
    assert not matcher.is_error()
