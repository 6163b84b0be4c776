// Request-body bounds for kvferry's cpp-httplib servers (`kvferry serve`, `kvferry proxy`; the
// bootstrap service has its own handler with its error format). Internal: include it only from
// a .cc file that uses httplib already.
//
// Why: cpp-httplib 0.11.4 enforces set_payload_max_length against a declared Content-Length
// only. A chunked body (Transfer-Encoding), or a POST without Content-Length (read until the
// connection closes), is read in full whatever its size — one client could exhaust the
// process's memory. A pre-routing handler runs before the body is read: a body-carrying request
// must declare a well-formed length (else 411 / 400, and the connection is closed), which
// httplib then holds to `max_body_bytes` (413).
#pragma once

#include <httplib.h>

#include <cstddef>
#include <string>

namespace kvferry::control {

inline void BoundRequestBodies(httplib::Server& server, std::size_t max_body_bytes) {
  server.set_payload_max_length(max_body_bytes);
  server.set_pre_routing_handler(
      [max_body_bytes](const httplib::Request& req, httplib::Response& res) {
        auto refuse = [&res](int status, const std::string& why) {
          res.status = status;
          res.set_header("Connection", "close");  // whatever follows is not read
          res.set_content("{\"error\":{\"message\":\"" + why +
                              "\",\"type\":\"invalid_request\"},\"object\":\"error\","
                              "\"message\":\"" +
                              why + "\"}",
                          "application/json");
          return httplib::Server::HandlerResponse::Handled;
        };
        if (req.has_header("Transfer-Encoding")) {
          return refuse(411, "chunked request bodies are not accepted: send Content-Length");
        }
        const bool has_body_method =
            req.method == "POST" || req.method == "PUT" || req.method == "PATCH";
        if (has_body_method && !req.has_header("Content-Length")) {
          return refuse(411, "a request body needs a Content-Length");
        }
        if (req.has_header("Content-Length")) {
          const std::string value = req.get_header_value("Content-Length");
          const bool digits = !value.empty() && value.size() <= 19 &&
                              value.find_first_not_of("0123456789") == std::string::npos;
          if (!digits) return refuse(400, "Content-Length is not a non-negative integer");
        }
        // A declared length above max_body_bytes: httplib's own check answers 413.
        (void)max_body_bytes;
        return httplib::Server::HandlerResponse::Unhandled;
      });
}

}  // namespace kvferry::control
