"""`accelab predict`: batch inference over a dataset with a Plan, in one process or many.

Modules, in the order a run uses them: `options` (checks, in the parent), `launch` (this
process, or torchrun), `worker` (one rank), `sources` (the inputs), `chunks` (the work plan),
`pipeline` (DataLoader), `tasks` (per-task encode / predict), `parts` (resumable chunk files),
`outputs` (the merged output), `report` (Result and table).
"""
