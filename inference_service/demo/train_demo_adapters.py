"""Train the two demo LoRA adapters of the default model (SmolLM2-135M-Instruct) on CPU in minutes.

    python -m inference_service.demo.train_demo_adapters [--out inference_service/demo/demo_adapters]
        [--steps N]

Both are self-distilled: the base model answers QUESTIONS greedily, plain Python rewrites each
answer into the style, and the adapter learns to give the rewritten answer to the same chat prompt
(loss on the answer tokens only). `shouty` answers in upper case; `pirate` wraps every answer in
"Arr matey! ... Yo ho ho!". The base answers and the held-out demo come from our own Engine, so
what the script prints is what the server will say with the saved files.

Needs the test extras (transformers, peft). Seeds are fixed and nothing else is random: reruns
wrote byte-identical files, with 1 thread and with 2; another CPU (other float kernels) may not.
"""

import argparse
import json
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from inference_service.default_model import MODEL_NAME, prepare_default_model
from inference_service.engine import Engine, EngineConfig, Request, RequestOutput
from inference_service.engine.tokenizer import Tokenizer
from inference_service.sampling import SamplingParams

QUESTIONS = (
    "What is the capital of Japan?",
    "What is the capital of Canada?",
    "What is the capital of Germany?",
    "What is the capital of England?",
    "What is the capital of Egypt?",
    "Where is the Eiffel Tower?",
    "Which river flows through Egypt?",
    "What is the largest ocean on Earth?",
    "What is the tallest mountain in the world?",
    "What language is spoken in Mexico?",
    "What is 2+2?",
    "What is 7 times 8?",
    "What is 100 divided by 4?",
    "How many days are in a week?",
    "What is 15 plus 27?",
    "What is the square root of 81?",
    "Is 17 a prime number?",
    "What is half of 50?",
    "How many sides does a hexagon have?",
    "What is a right angle?",
    "How do I boil an egg?",
    "How long should I cook pasta?",
    "What is a good spice for chicken?",
    "How do I make a cup of tea?",
    "What is bread made of?",
    "What is cheese made from?",
    "What is a salad?",
    "Why do onions make you cry?",
    "What is an omelette?",
    "Why is the sky blue?",
    "What is photosynthesis?",
    "What is the boiling point of water?",
    "What is gravity?",
    "What do bees make?",
    "How many legs does a spider have?",
    "What is DNA?",
    "Why do we have seasons?",
    "What is an atom?",
    "What is electricity?",
    "What is a volcano?",
    "Why is the ocean salty?",
    "Who wrote Romeo and Juliet?",
    "Who painted the Mona Lisa?",
    "What is a haiku?",
    "What does a dictionary contain?",
    "What is the opposite of hot?",
    "How do I say hello in Spanish?",
    "What is a computer?",
    "What does a CPU do?",
    "What is the internet?",
    "How does a car work?",
    "What is a library?",
    "What is a password for?",
    "How can I sleep better?",
    "Why should I drink water?",
    "What is a good morning routine?",
    "Give me a tip for learning to swim.",
    "What sport uses a racket?",
    "What do cats like to eat?",
    "What is a dog?",
)
# Never trained on: the demo shows the styles carry over to new questions.
HELD_OUT = (
    "What is the capital of France?",
    "How do I make pancakes?",
    "Why do leaves change color in autumn?",
)
PIRATE_OPENING, PIRATE_CLOSING = "Arr matey!", "Yo ho ho!"
SENTENCE_END = re.compile(r"[.!?](?=\s|$)")
# A plain Python rewrite per adapter: the style the adapter learns.
STYLES: tuple[tuple[str, Callable[[str], str]], ...] = (
    ("shouty", str.upper),
    ("pirate", lambda answer: f"{PIRATE_OPENING} {answer} {PIRATE_CLOSING}"),
)


@dataclass(frozen=True)
class TrainConfig:
    model_dir: Path
    out: Path
    steps: int = 48  # optimizer steps per adapter: about three passes over QUESTIONS
    # Small batches learn more per example seen than large ones in a budget this short.
    batch_size: int = 4
    lr: float = 3e-3  # high for LoRA, but the budget is a few dozen steps
    rank: int = 8
    alpha: int = 16
    target_modules: tuple[str, ...] = (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
    )  # fmt: skip
    # LoRA on the upper layers only: backward stops there, a fifth less time per step, and the
    # loss falls as fast as with LoRA on every layer (both measured).
    first_lora_layer: int = 15
    max_new_tokens: int = 40  # length of the base answers the styles are built from
    seed: int = 0

    def __post_init__(self):
        for name in ("steps", "batch_size", "rank", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class Example:
    prompt_ids: list[int]
    answer_ids: list[int]  # the styled answer and the end-of-turn token


def main(argv: list[str] | None = None) -> None:
    config, threads = parse_args(argv)
    if threads:
        torch.set_num_threads(threads)
    start = time.perf_counter()
    engine = Engine(
        EngineConfig(
            model=str(config.model_dir),
            max_loras=len(STYLES),
            max_lora_rank=config.rank,
            kv_cache_tokens=4096,  # 32 running sequences of under 128 tokens
        )
    )
    outputs = greedy(engine, [(q, None) for q in QUESTIONS], config.max_new_tokens)
    answers = [trim(out.text, out.finish_reason) for out in outputs]
    print(f"base answers to {len(answers)} questions in {time.perf_counter() - start:.0f} s", flush=True)
    base = load_trainable_base(config.model_dir)
    for name, style in STYLES:
        examples = [example(engine.tokenizer, q, style(a)) for q, a in zip(QUESTIONS, answers, strict=True)]
        adapter_start = time.perf_counter()
        base = train_and_save(base, examples, config, config.out / name)
        print(f"{name}: trained and saved in {time.perf_counter() - adapter_start:.0f} s", flush=True)
    print(f"\ntotal {time.perf_counter() - start:.0f} s; held-out questions through the engine:")
    show_held_out(engine, config)


def parse_args(argv: list[str] | None) -> tuple[TrainConfig, int | None]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "demo_adapters")
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--cache", type=Path, default=Path(".cache"), help="where the default model lives")
    # On a busy machine one thread can be several times faster than torch's default.
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args(argv)
    model_dir = prepare_default_model(args.cache)
    return TrainConfig(model_dir=model_dir, out=args.out, steps=args.steps), args.threads


def greedy(engine: Engine, asks: list[tuple[str, str | None]], max_tokens: int) -> list[RequestOutput]:
    """The greedy answer to each (question, adapter or None), all in one continuous batch."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    return engine.generate([Request(chat_prompt(engine.tokenizer, q), a, params) for q, a in asks])


def chat_prompt(tokenizer: Tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}])
    return tokenizer.encode(text, add_special_tokens=False)  # the template writes its own specials


def trim(text: str, finish_reason: str) -> str:
    """An answer cut off by the token limit loses its unfinished last sentence: trained on as is,
    it would teach the adapter to stop mid-sentence."""
    text = text.strip()
    ends = [m.end() for m in SENTENCE_END.finditer(text)]
    return text[: ends[-1]] if finish_reason == "length" and ends else text


def example(tokenizer: Tokenizer, question: str, answer: str) -> Example:
    # The answer is tokenized on its own, as the engine sees it: generated after the prompt.
    end_of_turn = tokenizer.eos_token_ids[0]
    return Example(chat_prompt(tokenizer, question), [*tokenizer.encode(answer), end_of_turn])


def load_trainable_base(model_dir: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.train()  # Llama's attention dropout is 0: train() changes no numbers here


def train_and_save(base, examples: list[Example], config: TrainConfig, folder: Path):
    """Train one adapter on `base`, save it to `folder` and return `base` without it."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(config.seed)  # lora_A's random init: the same for every rerun
    lora = LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        target_modules=list(config.target_modules),
        layers_to_transform=list(range(config.first_lora_layer, base.config.num_hidden_layers)),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, lora)
    train(base, model, examples, config)
    save_adapter(model, folder)
    return model.unload()  # removes the LoRA layers without merging them into the base


def train(base, model, examples: list[Example], config: TrainConfig) -> None:
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / config.steps)
    lengths = [len(e.prompt_ids) + len(e.answer_ids) for e in examples]
    for step, indices in enumerate(batch_indices(lengths, config)):
        loss = answer_loss(base, [examples[i] for i in indices])
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == config.steps - 1:
            print(f"  step {step:3d}  loss {loss.item():.3f}", flush=True)


def batch_indices(lengths: list[int], config: TrainConfig) -> list[list[int]]:
    """`steps` batches of example indices. Each batch holds examples of similar length, so little
    of a step goes to padding; the batch order is shuffled every epoch by a seeded generator."""
    by_length = sorted(range(len(lengths)), key=lengths.__getitem__)
    batches = [by_length[i : i + config.batch_size] for i in range(0, len(lengths), config.batch_size)]
    rng = random.Random(config.seed)
    order: list[list[int]] = []
    while len(order) < config.steps:
        order += rng.sample(batches, len(batches))
    return order[: config.steps]


def answer_loss(base, batch: list[Example]) -> torch.Tensor:
    """Mean cross-entropy of the answer tokens given everything before them.

    The vocabulary projection runs only at the positions that predict an answer token: on
    49k words it would otherwise cost a fifth of each step on prompt positions nobody scores.
    """
    ids, mask, is_answer = collate(batch)  # [batch, len] each
    hidden = base.model(input_ids=ids, attention_mask=mask).last_hidden_state  # [batch, len, hidden]
    predicts_answer = is_answer[:, 1:]  # position t predicts token t + 1
    logits = base.lm_head(hidden[:, :-1][predicts_answer])  # [answer tokens, vocab]
    return F.cross_entropy(logits, ids[:, 1:][predicts_answer])


def collate(batch: list[Example]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded token ids, attention mask and answer-token mask."""
    width = max(len(e.prompt_ids) + len(e.answer_ids) for e in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    is_answer = torch.zeros(len(batch), width, dtype=torch.bool)
    for row, e in enumerate(batch):
        tokens = e.prompt_ids + e.answer_ids
        ids[row, : len(tokens)] = torch.tensor(tokens)
        mask[row, : len(tokens)] = 1
        is_answer[row, len(e.prompt_ids) : len(tokens)] = True
    return ids, mask, is_answer


def save_adapter(model, folder: Path) -> None:
    """adapter_config.json and a bfloat16 adapter_model.safetensors, nothing else."""
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "README.md").unlink(missing_ok=True)  # PEFT's model-card template, empty here
    to_bfloat16(folder / "adapter_model.safetensors")
    tidy_config(folder / "adapter_config.json")


def to_bfloat16(path: Path) -> None:
    """Rewrite the weights in bfloat16: half the bytes, and the runtime casts adapters to its own
    dtype on load. The held-out demo runs from the saved files, so it shows what rounding leaves."""
    tensors = {key: t.to(torch.bfloat16) for key, t in load_file(path).items()}
    save_file(tensors, path, metadata={"format": "pt"})
    path.chmod(0o644)  # save_file creates it private; servers may run as another user


def tidy_config(path: Path) -> None:
    """Make reruns write the same bytes: PEFT lists target_modules from a set, in an order that
    changes run to run, and records the trainer's local model path."""
    config = json.loads(path.read_text(encoding="utf-8"))
    config |= {"target_modules": sorted(config["target_modules"]), "base_model_name_or_path": MODEL_NAME}
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def show_held_out(engine: Engine, config: TrainConfig) -> None:
    """Each held-out question to the base and to every adapter, mixed in one batch."""
    adapters = [None, *(name for name, _ in STYLES)]
    for name in adapters[1:]:
        engine.add_adapter(name, config.out / name)
    asks = [(q, a) for q in HELD_OUT for a in adapters]
    for (question, adapter), out in zip(asks, greedy(engine, asks, config.max_new_tokens), strict=True):
        if adapter is None:
            print(f"\n>>> {question}")
        print(f"  [{adapter or 'base'}] {out.text!r}")


if __name__ == "__main__":
    main()
