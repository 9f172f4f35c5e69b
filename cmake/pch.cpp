// Translation unit that owns the precompiled header build (see cmake/kiln.cmake).
