"""The engine, in rooms by concern, each importing only rooms below it: ``planning`` (checked
arguments to a plan, memory plans) over ``step`` (units, the schedule, its hooks) over
``buckets`` (flat buffers and their memory) over ``params`` (a parameter's layout, pieces and
DTensor faces) over ``groups`` (process groups, meshes, collectives), with ``config`` at the foot."""
