"""Documents inside a packed window: numbering them and where each one starts.

Shared by the loader (which derives document ids and restarted positions) and the attention kernels
(which mask by document); a leaf module so both can import it.
"""

import torch


def document_ids_from_bos(tokens: torch.Tensor, bos_id: int) -> torch.Tensor:
    """Every document starts with BOS, so the running count of BOS tokens numbers the documents of a
    window (a window starting inside a document gives that partial document id 0)."""
    return torch.cumsum(tokens == bos_id, dim=-1)


def document_start_index(document_ids: torch.Tensor) -> torch.Tensor:
    """Per position, the index of the first position of its document (documents are contiguous runs)."""
    idx = torch.arange(document_ids.shape[-1], device=document_ids.device).expand_as(document_ids)
    starts_here = torch.ones_like(document_ids, dtype=torch.bool)
    starts_here[..., 1:] = document_ids[..., 1:] != document_ids[..., :-1]
    return torch.cummax(torch.where(starts_here, idx, torch.zeros_like(idx)), dim=-1).values




def positions_in_documents(document_ids: torch.Tensor) -> torch.Tensor:
    """Per position, its offset inside its document (RoPE positions restarting at every document)."""
    idx = torch.arange(document_ids.shape[-1], device=document_ids.device).expand_as(document_ids)
    return idx - document_start_index(document_ids)
