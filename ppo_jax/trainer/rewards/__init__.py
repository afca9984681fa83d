"""Rewards computed on decoded text (`reward.kind: function`).

  functions.py    the registry of reward functions (`reward.function`): VADER sentiment,
                  response length, verifiable rewards (math_verify, reasoning_gym, with an
                  optional format weight); a fork registers its own with
                  `register_reward_function`
  calls.py        each call checked (one finite number per response, exceptions named) and
                  the load-time probe on placeholder responses
  deadline.py     `reward.timeout_s`: a watchdog that stops a call in the main thread
  verifiers.py    what answer a response gives (`<answer>` tags) and whether it is right
"""
