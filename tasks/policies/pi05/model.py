"""pi0.5 (transformers' `PI05ForConditionalGeneration`) behind dagrl's Policy protocol: pi0's wrapper
(tasks.policies.pi0.model, where the RL glue is documented) with the two differences of the library's model:
the state is not a model input but part of the prompt (`PI05Processor` normalises it, by quantiles when the
checkpoint's processor has them, and writes its 256-bin discretisation after the task), and the action expert is
conditioned on the time through adaptive RMS norms. The value head therefore reads the prefix features alone
(they see the state through the prompt)."""
from __future__ import annotations

from tasks.policies.pi0.model import PI0Policy


class PI05Policy(PI0Policy):
    """pi0.5 from transformers with dagrl's RL; arguments, shapes and errors as `PI0Policy` (O is not bounded by
    max_state_dim: the state goes into the prompt, whose length is policy.max_prompt_len)."""

    family = "pi05"
    state_input = False

    def _draws(self, n: int, device, dtype):
        """As `PI0Policy._draws`, in PI05ForConditionalGeneration.forward's order: the noise, then t."""
        noise = self._draw_noise(n, device, dtype)
        return self._draw_time(n, device), noise
