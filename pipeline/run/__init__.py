"""A job: its config, the driver (Ray Data stages, part writer), the actor (model work), the output store."""
