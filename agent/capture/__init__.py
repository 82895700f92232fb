"""State capture across re-entry: what a worker's function holds (locals, tensor containers, modules it built,
data loaders, copies it carried) found at the boundary and written back when the function re-enters on
another agent after a resize or a restart."""
