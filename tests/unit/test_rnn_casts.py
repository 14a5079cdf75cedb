"""RNN modules and cells under apex's O1/O4 lists, as apex's ``test_rnn.py`` checks them, and beyond.

Where the lists apply without device autocast (the legacy ``amp.init()`` handle, the window after a
forward, process-wide casting under ``python -m ampddp.apex``) torch's ``RNNBase`` refuses a half
input to fp32 weights before any op runs; ampddp aligns that input first. Outputs are low precision,
input gradients come back in the input's dtype, and values agree with an fp32 run.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampddp.apex.amp as apex_amp
from ampddp.amp import Amp

H, B, T = 16, 4, 5
RNNS = [
    ("rnn", lambda: nn.RNN(H, H, num_layers=1, nonlinearity="relu"), False),
    ("rnn-2-bidir", lambda: nn.RNN(H, H, num_layers=2, nonlinearity="relu", bidirectional=True), False),
    ("gru-2", lambda: nn.GRU(H, H, num_layers=2), False),
    ("gru-2-bidir", lambda: nn.GRU(H, H, num_layers=2, bidirectional=True), False),
    ("lstm-2", lambda: nn.LSTM(H, H, num_layers=2), True),
    ("lstm-2-bidir", lambda: nn.LSTM(H, H, num_layers=2, bidirectional=True), True),
]
CELLS = [("rnn-cell", nn.RNNCell, False), ("gru-cell", nn.GRUCell, False), ("lstm-cell", nn.LSTMCell, True)]
HANDLES = [("O1", torch.float16), ("O4", torch.bfloat16)]
TORCH_RNN_DTYPE_ERROR = "does not match weight dtype|input must have the type"
"""torch's refusal of a half input to fp32 RNN weights, as worded by recent releases and by 2.10."""


def run_rnn(rnn, typ, state_tuple):
    layers = rnn.num_layers * (2 if rnn.bidirectional else 1)
    torch.manual_seed(3)
    x = torch.randn((T, B, H)).to(typ).requires_grad_()  # drawn in fp32: randn's low-precision draws differ by release
    hidden = torch.zeros((layers, B, H), dtype=typ)
    output, _ = rnn(x, (hidden, hidden.clone()) if state_tuple else hidden)
    output[-1].float().sum().backward()
    return x, output


@pytest.mark.parametrize("level, low", HANDLES, ids=[h[0] for h in HANDLES])
@pytest.mark.parametrize("name, make, state_tuple", RNNS, ids=[r[0] for r in RNNS])
def test_rnns_under_the_legacy_handle_run_low_with_fp32_and_low_inputs(name, make, state_tuple, level, low):
    torch.manual_seed(0)
    rnn = make()
    _, reference = run_rnn(rnn, torch.float32, state_tuple)
    handle = apex_amp.init(enabled=True, patch_type=low)
    try:
        for typ in (torch.float32, low):
            x, output = run_rnn(rnn, typ, state_tuple)
            assert output.dtype == low
            assert x.grad.dtype == typ
            assert torch.allclose(output.float(), reference, atol=0.05, rtol=0.05)
    finally:
        handle._deactivate()
    assert rnn(torch.randn(T, B, H))[0].dtype == torch.float32  # nothing left behind


@pytest.mark.parametrize("name, cell_type, state_tuple", CELLS, ids=[c[0] for c in CELLS])
def test_cells_under_the_legacy_handle_are_half(name, cell_type, state_tuple):
    cell = cell_type(H, H)
    handle = apex_amp.init(enabled=True)
    try:
        for typ in (torch.float32, torch.float16):
            xs = [torch.randn((B, H), dtype=typ).requires_grad_() for _ in range(T)]
            hidden = (torch.zeros((B, H), dtype=typ),) * 2 if state_tuple else torch.zeros((B, H), dtype=typ)
            outputs = []
            for x in xs:
                hidden = cell(x, hidden)
                outputs.append(hidden[0] if state_tuple else hidden)
            assert all(y.dtype == torch.float16 for y in outputs)
            outputs[-1].float().sum().backward()
            assert all(x.grad.dtype == typ for x in xs)
    finally:
        handle._deactivate()


def test_a_packed_sequence_under_the_legacy_handle_is_half():
    rnn = nn.RNN(H, H, num_layers=2)
    handle = apex_amp.init(enabled=True)
    try:
        for typ in (torch.float32, torch.float16):
            x = torch.randn((T, B, H), dtype=typ).requires_grad_()
            lengths = torch.tensor(sorted((random.Random(1).randint(T // 2, T) for _ in range(B)), reverse=True))
            packed = nn.utils.rnn.pack_padded_sequence(x, lengths)
            output, _ = rnn(packed, torch.zeros((2, B, H), dtype=typ))
            assert output.data.dtype == torch.float16
            output.data.float().sum().backward()
            assert x.grad.dtype == typ
    finally:
        handle._deactivate()


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(H, H, num_layers=2, bidirectional=True)
        self.head = nn.Linear(2 * H, 3)

    def forward(self, x):
        return self.head(self.lstm(x)[0])


@pytest.mark.parametrize("level, low", HANDLES, ids=[h[0] for h in HANDLES])
def test_an_initialized_lstm_model_trains_with_low_inputs_close_to_fp32(level, low):
    torch.manual_seed(0)
    reference_model = Tagger()
    model = Tagger()
    model.load_state_dict(reference_model.state_dict())
    amp = Amp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, verbosity=0)
    reference_optimizer = torch.optim.SGD(reference_model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(T, B, H, generator=torch.Generator().manual_seed(step))
        y = torch.randint(0, 3, (T * B,), generator=torch.Generator().manual_seed(step))
        output = model(x.to(low))
        assert output.dtype == low
        with amp.scale_loss(F.cross_entropy(output.reshape(-1, 3), y), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
        F.cross_entropy(reference_model(x).reshape(-1, 3), y).backward()
        reference_optimizer.step()
    for got, want in zip(model.parameters(), reference_model.parameters()):
        assert torch.allclose(got, want, atol=0.02, rtol=0.02)


def test_process_wide_casts_reach_an_rnn_never_given_to_initialize():
    amp = Amp()
    with amp.process_wide_casts():
        model = nn.Linear(H, H)
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1", verbosity=0)
        gru = nn.GRU(H, H)
        output, _ = gru(torch.randn(T, B, H, dtype=torch.float16))
        assert output.dtype == torch.float16
    assert gru(torch.randn(T, B, H))[0].dtype == torch.float32
    with pytest.raises(ValueError, match=TORCH_RNN_DTYPE_ERROR):  # torch's own check, once nothing casts
        gru(torch.randn(T, B, H, dtype=torch.float16))


def test_the_rnn_hook_goes_when_a_thread_ends_with_its_lists_applied():
    import threading

    from torch.nn.modules import module as torch_module

    before = len(torch_module._global_forward_pre_hooks)
    amp = Amp()
    model = nn.Linear(H, H)
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1", verbosity=0)

    def forward_and_leave():
        apex_amp.init(enabled=True)  # the lists stay applied on this thread: it ends without _deactivate
        nn.GRU(H, H)(torch.randn(T, B, H, dtype=torch.float16))

    thread = threading.Thread(target=forward_and_leave)
    thread.start()
    thread.join()
    gru = nn.GRU(H, H)
    with pytest.raises(ValueError, match=TORCH_RNN_DTYPE_ERROR):  # not this thread's lists: torch's check
        gru(torch.randn(T, B, H, dtype=torch.float16))
    model(torch.randn(2, H))  # a window opens and closes here: the dead thread's share is dropped
    amp.end_casts()
    assert len(torch_module._global_forward_pre_hooks) == before
