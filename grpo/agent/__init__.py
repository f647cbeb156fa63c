"""Your own agent loop: the sampler serves the policy as an OpenAI-compatible endpoint and trains on every turn the
model writes for it (docs/environments.md, "Your own agent loop").

runner.py runs a step's samples as sessions, each an episode of the engines' episode loops, and starts
agent.entrypoint per session (harness.py), or agent.command's program in a jail (command.py); server.py is the
HTTP endpoint (requests.py: what a request may ask); bridge.py one session's exchange (its
requests in, the model's turns out, each side waiting with a time limit); history.py and tokens.py the prefix
rule (a later request is the conversation served, continued, and the row goes on with exact tokens);
messages.py the sampled text as the assistant message a response carries.
"""
