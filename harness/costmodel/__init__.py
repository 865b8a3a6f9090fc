"""The step-cost model: what a step's work is (work), what it costs (a profile), and how a
measured profile is fitted (fit) or a roofline one derived (roofline). No MLX here: a
profile replays on any machine."""
