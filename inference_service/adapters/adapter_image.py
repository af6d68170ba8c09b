"""AdapterImage: an adapter laid out as its pages of adapter memory hold it (kernels/lora_batch.py
gives the layout), built once when it is loaded, off the step thread. Activating it is then one
copy per page, of all layers at once, with nothing to zero: the image holds the zeros of the rank
rows past each module's rank and of the layers the adapter leaves alone. The vocabulary side's
parts (model/vocab_layout.py) come last, as the units of their run."""

from dataclasses import dataclass, replace

import torch

from inference_service.model.adapter_units import unit_elements
from inference_service.model.shard import Shard
from inference_service.model.vocab_layout import VocabLayout
from kernels.lora_batch import PAGE_RANK, page_width
from shared.model_config import LinearShape, ModelConfig
from shared.peft_checkpoint import AdapterWeights, ModuleLora


@dataclass(frozen=True)
class AdapterImage:
    ranks: tuple[int, ...]  # [targets]: the largest rank over layers, lora_targets order (0: none)
    # [targets] of [pages_t, layers, experts_t * PAGE_RANK * (in_t + gathered_t * out_t)], then the
    # vocabulary side's run [units, layers, unit]
    pages: tuple[torch.Tensor, ...]
    vocab: VocabLayout | None = None  # where the run holds the vocabulary side's parts

    @property
    def need(self) -> tuple[int, ...]:
        """Pages per target: ceil(rank_t / PAGE_RANK); then the vocabulary side's units."""
        return tuple(image.shape[0] for image in self.pages)

    @classmethod
    def of(
        cls, weights: AdapterWeights, model: ModelConfig, dtype: torch.dtype, shard: Shard | None = None
    ) -> "AdapterImage":
        """The image in `dtype` (the serving dtype); under tensor parallelism, of the part of the
        adapter `shard`'s rank holds. Raises ValueError for weights the model cannot take: a layer
        it lacks, or a module shaped for another model."""
        if shard is not None and shard.size > 1:
            weights, model = shard.adapter(weights, model), shard.config(model)
        shapes, targets = model.linear_shapes(), model.lora_targets
        ranks = tuple(weights.module_ranks.get(target, 0) for target in targets)
        pages = tuple(
            torch.empty(-(-rank // PAGE_RANK), model.num_layers, _width(shapes[target]), dtype=dtype)
            for target, rank in zip(targets, ranks, strict=True)
        )  # [pages_t, layers, page width] each
        placed: set[tuple[int, str]] = set()
        for (layer, module), lora in weights.modules.items():
            if not 0 <= layer < model.num_layers:
                raise ValueError(f"layers.{layer}.{module}: the model has layers 0..{model.num_layers - 1}")
            if module not in targets:
                raise ValueError(f"layers.{layer}.{module}: LoRA cannot target {module} on this model")
            _place(pages[targets.index(module)][:, layer], lora, module, shapes[module])
            placed.add((layer, module))
        for target, image in zip(targets, pages, strict=True):
            for layer in range(model.num_layers):
                if (layer, target) not in placed:
                    image[:, layer].zero_()  # a layer the adapter leaves alone
        layout = VocabLayout.of(weights.vocab, model.num_layers)
        unit = unit_elements(model)
        run = (
            layout.image(weights.vocab, model.num_layers, unit, dtype)
            if layout
            else torch.empty(0, model.num_layers, unit, dtype=dtype)
        )  # [units, layers, unit]
        return cls(ranks, (*pages, run), layout)

    def check_fits(
        self,
        pages: tuple[tuple[int, ...], ...],
        targets: tuple[str, ...],
        num_layers: int,
        widths: list[int],
        max_rank: int,
    ) -> None:
        """Refuse an image the memory's layout cannot hold (a loader that skipped its checks): a
        rank past max_lora_rank (the step tables hold that many pages), or pages not shaped as
        the model's pages (`widths` per target, the vocabulary side's run last) and the ones
        acquired for it."""
        for target, rank in zip(targets, self.ranks, strict=False):
            if rank > max_rank:
                raise ValueError(f"{target} has rank {rank}, above max_lora_rank {max_rank}")
        for target, image_pages, units, width in zip(targets, self.pages, pages, widths, strict=True):
            if image_pages.shape != (len(units), num_layers, width):
                raise ValueError(
                    f"{target} pages are {tuple(image_pages.shape)}; the adapter memory holds "
                    f"{(len(units), num_layers, width)}"
                )

    def pin_memory(self) -> "AdapterImage":
        """A copy in page-locked host memory, so copies to the device from it run async."""
        return replace(self, pages=tuple(image.pin_memory() for image in self.pages))


def _width(shape: LinearShape) -> int:
    """A page's width: every expert's block of it."""
    return shape.experts * page_width(shape.in_features, shape.out_features, shape.gathered)


def _place(image: torch.Tensor, lora: ModuleLora, module: str, shape: LinearShape) -> None:
    """Write one module's A and B^T rows into its layer's pages `image` [pages, width]: page g
    holds rank rows PAGE_RANK*g .. PAGE_RANK*g + 7, A's then B^T's (of a gathered target, those
    rows of every rank's part of B, rank after rank); an expert target's page holds them for
    expert 0, then expert 1, ..."""
    in_features, out_features, experts, gathered = (
        shape.in_features,
        shape.out_features,
        shape.experts,
        shape.gathered,
    )
    stack = (experts,) if experts > 1 else ()
    rank = lora.rank
    want_b = (*stack, gathered * rank, out_features)
    if lora.a.shape != (*stack, rank, in_features) or lora.b_t.shape != want_b:
        raise ValueError(
            f"{module}: A {tuple(lora.a.shape)} and B^T {tuple(lora.b_t.shape)} do not fit the "
            f"model's [{', '.join(map(str, [*stack, 'r', in_features]))}] and "
            f"[{', '.join(map(str, [*stack, 'r' if gathered == 1 else f'{gathered}r', out_features]))}]"
        )
    blocks = image.unflatten(1, (experts, -1))  # [pages, experts, page width]
    a = blocks[..., : PAGE_RANK * in_features].unflatten(2, (PAGE_RANK, in_features))  # [pages, E, 8, in]
    b = blocks[..., PAGE_RANK * in_features :].unflatten(
        2, (gathered, PAGE_RANK, out_features)
    )  # [pages, E, g, 8, out]
    lora_a = lora.a.reshape(experts, rank, in_features)
    lora_b = lora.b_t.reshape(experts, gathered, rank, out_features)
    full, rest = divmod(rank, PAGE_RANK)
    # zeros for the rank rows past this module's: its last page's tail, the pages a larger rank
    # of the same target in another layer needs
    a[full:].zero_()
    b[full:].zero_()
    a[:full].copy_(lora_a[:, : full * PAGE_RANK].unflatten(1, (full, PAGE_RANK)).transpose(0, 1))
    b[:full].copy_(lora_b[:, :, : full * PAGE_RANK].unflatten(2, (full, PAGE_RANK)).permute(2, 0, 1, 3, 4))
    if rest:
        a[full, :, :rest].copy_(lora_a[:, full * PAGE_RANK :])
        b[full, :, :, :rest].copy_(lora_b[:, :, full * PAGE_RANK :])
