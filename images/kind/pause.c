/*
 * The pod sandbox's process: holds the pod's namespaces open and does nothing else.
 * It reaps the children that end up with it as their parent (it is PID 1 when a pod
 * shares its process namespace) and exits on SIGINT or SIGTERM. Built static, it is the
 * whole of the node's pause image: no registry can serve the usual one here.
 */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int sig) { _exit(128 + sig); }

static void reap(int sig) {
  (void)sig;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(void) {
  struct sigaction on_stop = {.sa_handler = stop};
  struct sigaction on_child = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP};
  if (sigaction(SIGINT, &on_stop, NULL) || sigaction(SIGTERM, &on_stop, NULL) ||
      sigaction(SIGCHLD, &on_child, NULL)) {
    return 1;
  }
  for (;;) pause();
}
