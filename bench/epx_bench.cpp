#include <cstdio>

int main() {
  std::printf("epx-bench: not implemented yet\n");
  return 0;
}
