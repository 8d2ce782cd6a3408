"""Stand-in for mindpandas (the online example imports it only for its channel's DataReceiver)."""
