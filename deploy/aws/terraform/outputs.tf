output "control_plane_public_ip" {
  description = "Public IPv4 address of the control-plane node (SSH, kubectl via 6443)."
  value       = aws_instance.control_plane.public_ip
}

output "control_plane_private_ip" {
  description = "Private IPv4 address of the control-plane node (API server, registry)."
  value       = aws_instance.control_plane.private_ip
}

output "worker_public_ips" {
  description = "Public IPv4 addresses of the workers, in order."
  value       = aws_instance.worker[*].public_ip
}

output "worker_private_ips" {
  description = "Private IPv4 addresses of the workers, in order."
  value       = aws_instance.worker[*].private_ip
}

output "registry_endpoint" {
  description = "Checkpoint image registry (plain HTTP, reachable inside the VPC only)."
  value       = "${aws_instance.control_plane.private_ip}:${local.registry_port}"
}

output "ssh_user" {
  description = "Login user of the chosen image."
  value       = local.ssh_users[var.os_image]
}

output "ansible_inventory_path" {
  description = "The generated Ansible inventory."
  value       = local_file.ansible_inventory.filename
}
