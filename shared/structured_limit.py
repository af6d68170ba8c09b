"""The most characters one output constraint's text may take (a JSON schema, a regex, a grammar, or
a choice's strings together): the worker refuses a longer one (inference_service/sampling.py), and
the gateway fits the tools' constraints within it (openai_gateway/constraints.py). It bounds what
a compile costs: grammars nest as deep as their text is long, and their compile recurses as deep
(engine/grammars.py sizes the compile threads' stacks for it)."""

MAX_STRUCTURED_CHARS = 64 << 10
