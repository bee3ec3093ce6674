"""The packing pipeline feeds HybridLM exactly: packer -> collate_thd -> process_input_for_thd
-> PackedSeqParams.from_batch, and every document's logits equal the document run alone."""

import pytest
import torch

from hybridpar.data.packing import collate_thd, pack_documents
from hybridpar.data.thd import PackedSeqParams
from hybridpar.models.hybrid import HybridConfig, HybridLM


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_packed_pipeline_batch_equals_each_document_alone(cp_size):
    torch.manual_seed(0)
    model = HybridLM(HybridConfig.from_preset("tiny", pattern="M*-M", chunk_size=16, dtype=torch.float64))
    generator = torch.Generator().manual_seed(1)
    lengths = [16, 32, 5, 19, 11, 1, 24]  # at cp=1 the first boundaries fall on 16-token chunk edges
    docs = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in lengths]
    packs = pack_documents(docs, pack_size=160, cp_size=cp_size)
    checked = 0
    for pack in packs:
        batch = collate_thd([pack])
        packed = PackedSeqParams.from_batch(batch)
        logits = model(batch["input_ids"], packed=packed)[0]  # [T, V]
        starts = torch.cat([torch.zeros(1, dtype=torch.long), pack["seq_lens_padded"].cumsum(0)[:-1]])
        for index, start, real in zip(pack["document_index"], starts, pack["seq_lens"]):
            alone = model(torch.tensor([docs[index]]))[0]
            torch.testing.assert_close(logits[start:start + real], alone, rtol=1e-10, atol=1e-10)
            checked += 1
    assert checked == len(docs)
