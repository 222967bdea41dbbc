"""Agentic episodes: the controller's multi-turn loop over rollout workers and environment servers.

``render`` (chat-template deltas), ``toolcalls`` (Hermes tool calls), ``loop`` (one episode, token-in/token-out),
``turns`` (turns on the workers), ``envpool`` (environment sessions), ``runner`` (GRPO groups of episodes for the
controller), ``stats`` (a batch's episode statistics). docs/agentic.md tells the whole story.
"""
