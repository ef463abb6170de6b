#include "copier_fork.hpp"

#include <pthread.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "copier.hpp"

namespace mapoffload {

namespace {

// Never destroyed: copiers may outlive static destruction at exit.
std::mutex& registry_mutex() {
  static std::mutex* mu = new std::mutex;
  return *mu;
}
std::vector<Copier*>& registry() {
  static auto* v = new std::vector<Copier*>;
  return *v;
}

void prepare() {
  registry_mutex().lock();
  for (Copier* c : registry()) c->fork_prepare();
}

void parent() {
  auto& r = registry();
  for (auto it = r.rbegin(); it != r.rend(); ++it) (*it)->fork_parent();
  registry_mutex().unlock();
}

void child() {
  for (Copier* c : registry()) c->fork_child();
  registry_mutex().unlock();  // held by this very thread, the child's only one
}

}  // namespace

void register_copier(Copier* c) {
  static std::once_flag once;
  std::call_once(once, [] { pthread_atfork(prepare, parent, child); });
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry().push_back(c);
}

void unregister_copier(Copier* c) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto& r = registry();
  r.erase(std::remove(r.begin(), r.end(), c), r.end());
}

}  // namespace mapoffload
