// Where a runtime component's warnings go (default: spdlog::warn). Tests count them.
#pragma once

#include <functional>
#include <string_view>

namespace kvferry::control {

using WarningSink = std::function<void(std::string_view message)>;

}  // namespace kvferry::control
