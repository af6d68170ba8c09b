"""A conversation rendered with its final message left open, so that the reply continues it (an
answer begun for the model), as transformers' continue_final_message renders it: the final
message's text is marked at its end, the conversation rendered, and the prompt cut at the mark,
leaving out what the template writes after the text (its end of turn, a generation prompt).
A template that trims the text trims the space that ends it too, as transformers' cut does."""

import uuid

from shared.errors import InvalidArgument


def marked(messages: list[dict]) -> tuple[list[dict], str]:
    """The messages with a mark after the final message's text, and the mark: a random one, which no
    message's text holds."""
    if not messages:
        raise InvalidArgument("continue_final_message needs a final message to continue")
    mark = f"<continue-{uuid.uuid4().hex}> "
    final = {**messages[-1], "content": messages[-1]["content"] + mark}
    return [*messages[:-1], final], mark


def cut_at(rendered: str, mark: str) -> str:
    """The rendered conversation up to the mark: where the template wrote it whole, the text before
    it as it was; where the template trimmed the space that ends it, the text before it trimmed."""
    at = rendered.rfind(mark.rstrip())
    if at < 0:
        raise InvalidArgument(
            "continue_final_message: the chat template leaves out the end of the final message, so "
            "the reply cannot continue it"
        )
    whole = rendered.startswith(mark, at)
    return rendered[:at] if whole else rendered[:at].rstrip()
