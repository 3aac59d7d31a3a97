"""Agent programs shipped as examples: each written against the `openai` client alone, as a user's would be (see
`baton.agentic.agent` for the contract)."""
