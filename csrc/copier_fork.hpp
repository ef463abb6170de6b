// Process-wide registry of live copiers, for fork(): pthread_atfork handlers
// lock every copier before the fork (so the child never inherits a mutex held
// half-way through an update) and let each repair itself in the child.
#pragma once

namespace mapoffload {

class Copier;

void register_copier(Copier* c);
void unregister_copier(Copier* c);

}  // namespace mapoffload
