"""The offline source: (prompt, response) rows, tokenised and collated (SFT)."""

from __future__ import annotations

from posttrain.core.batch import Batch, collate
from posttrain.data import RowSampler, prompt_ids, response_ids
from posttrain.schema import DataConfig
from posttrain.sources.base import Source, register


@register("offline")
class Offline(Source):

    def __init__(self, sampler: RowSampler, tokenizer, data: DataConfig, batch_size: int):
        self.sampler, self.tokenizer, self.data, self.batch_size = sampler, tokenizer, data, batch_size

    @staticmethod
    def row_fields(data: DataConfig) -> list[str]:
        return [data.prompt_field, data.response_field]

    @classmethod
    def from_deps(cls, d) -> Offline:
        return cls(d.sampler, d.tokenizer, d.data, d.batch_size)

    def next(self) -> tuple[Batch, dict]:
        rows = self.sampler.next(self.batch_size)
        tok = self.tokenizer
        return collate(prompt_ids(tok, rows, self.data), response_ids(tok, rows, self.data), tok.pad_token_id), {}
